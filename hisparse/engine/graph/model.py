"""Weights and math of the GPU-bound decode step (bf16, DeepSeek-V3.2 attention shapes).

Every function here is shape-generic over the batch rows it is given, so the step can run the
batch whole or in parts. Attention reads its KV as rows of bytes gathered by index into a
[n, top_k, 656] buffer and decoded with `hisparse.models.rows.decode_rows`: resident and HiSparse
hand it the same bytes in the same order, so they compute bit-identical results.
"""

from __future__ import annotations

import torch

from hisparse.engine.graph import kernels
from hisparse.engine.graph.config import GraphConfig
from hisparse.models.dsa.kernels import mla as mla_kernel
from hisparse.models.rows import decode_rows

DT = torch.bfloat16
# The indexer's scores only perturb the staged selection bias (integer-spaced ranks): squashed
# into (-0.25, 0.25) they reorder near-ties without overriding the bias.
SCORE_SQUASH = 0.25


def _w(g: torch.Generator, device, *shape, fan_in: int) -> torch.Tensor:
    """Random weight scaled by 1/sqrt(fan_in): activations keep unit scale through the layers."""
    t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
    return (t * fan_in**-0.5).to(DT)


class Weights:
    """Every layer's weights plus the tied embedding / LM head, drawn from `cfg.seed`."""

    def __init__(self, cfg: GraphConfig, device) -> None:
        g = torch.Generator(device=device).manual_seed(cfg.seed)
        D, Hq, Q = cfg.hidden, cfg.heads, cfg.q_lora
        self.embed = _w(g, device, cfg.vocab, D, fan_in=1)
        self.final_norm = torch.ones(D, dtype=DT, device=device)
        self.layers = []
        for _ in range(cfg.layers):
            w = dict(
                attn_norm=torch.ones(D, dtype=DT, device=device),
                q_a=_w(g, device, D, Q, fan_in=D),
                q_norm=torch.ones(Q, dtype=DT, device=device),
                q_b=_w(g, device, Q, Hq * (cfg.nope + cfg.rope), fan_in=Q),
                w_uk=_w(g, device, Hq, cfg.nope, cfg.latent, fan_in=cfg.nope),
                w_uv=_w(g, device, Hq, cfg.latent, cfg.v_head, fan_in=cfg.latent),
                o=_w(g, device, Hq * cfg.v_head, D, fan_in=Hq * cfg.v_head),
                idx_q=_w(g, device, Q, cfg.idx_heads * cfg.idx_dim, fan_in=Q),
                idx_w=_w(g, device, D, cfg.idx_heads, fan_in=D),
                mlp_norm=torch.ones(D, dtype=DT, device=device),
                w13=_w(g, device, D, 2 * cfg.mlp_inter, fan_in=D),
                w2=_w(g, device, cfg.mlp_inter, D, fan_in=cfg.mlp_inter),
            )
            self.layers.append(w)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(DT) * w


def indexer_scores(
    cfg: GraphConfig, w: dict, qr: torch.Tensor, a: torch.Tensor, keys: tuple, fused: bool
) -> torch.Tensor:
    """DSA indexer: sum_h w_h * relu(q_h . k_t) over each request's context keys, k_t an FP8 key
    times its scale; ``fused``: the Triton kernel (float32 throughout, the FP8 keys read once),
    else bf16 matrix products over the dequantized keys.

    qr [n, q_lora], a [n, hidden], keys (fp8 [n, ctx, idx_dim], scales [n, ctx]) -> scores
    [n, ctx] fp32."""
    n = qr.shape[0]
    q = (qr @ w["idx_q"]).view(n, cfg.idx_heads, cfg.idx_dim)
    hw = a @ w["idx_w"]
    k8, scales = keys
    if fused:
        return kernels.indexer_scores(q, hw, k8, scales)
    k = (k8.to(torch.float32) * scales[..., None]).to(DT)
    logits = torch.bmm(q, k.transpose(1, 2)).relu_()  # [n, idx_heads, ctx]
    return torch.bmm(hw.view(n, 1, cfg.idx_heads), logits).view(n, -1).float()


def select(scores: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """Top-k context positions [n, top_k] int64 of the squashed scores plus the staged bias, in
    ascending position order: the order attention sums in is then fixed by the set alone, not by
    how topk orders its output (the order of equal values is not specified)."""
    s = torch.tanh(scores).mul_(SCORE_SQUASH).add_(bias)
    return torch.topk(s, top_k, dim=1, sorted=False).indices.sort(dim=1).values


def query(cfg: GraphConfig, w: dict, qr: torch.Tensor) -> torch.Tensor:
    """Absorbed MLA query [n, heads, latent + rope]: q_nope folded through W_UK into the latent."""
    n = qr.shape[0]
    q = (qr @ w["q_b"]).view(n, cfg.heads, cfg.nope + cfg.rope)
    q_nope, q_rope = q[..., : cfg.nope], q[..., cfg.nope :]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w["w_uk"]).transpose(0, 1)  # [n, heads, latent]
    return torch.cat([q_lat, q_rope], dim=-1)


def read_rows(src: torch.Tensor, ids: torch.Tensor, fused: bool) -> torch.Tensor:
    """Rows ``ids`` [n, top_k] of ``src`` (uint8 [rows, 656]) as bf16 values [n, top_k, 576]:
    one Triton pass when ``fused``, else a gather then ``decode_rows`` (the same values)."""
    if fused:
        return kernels.gather_decode(src, ids)
    rows = src.index_select(0, ids.reshape(-1)).view(*ids.shape, -1)
    return decode_rows(rows, "fp8", DT)


def _scale(cfg: GraphConfig) -> float:
    return (cfg.nope + cfg.rope) ** -0.5


def attend_rows(cfg: GraphConfig, q, src: torch.Tensor, ids: torch.Tensor, splits: int = 1):
    """``attend(cfg, q, read_rows(src, ids, True))`` in one Triton kernel (rows and scores never
    materialized; float32 scores and softmax, so close to it but not bit-identical), each
    request's rows in ``splits`` runs (``mla_kernel.splits_for``)."""
    return mla_kernel.sparse_mla(q, src, ids, _scale(cfg), splits=splits)


def attend(cfg: GraphConfig, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Sparse MLA over the selected rows: q [n, heads, 576], kv [n, top_k, 576] ->
    latent mix [n, heads, latent]."""
    scale = _scale(cfg)
    # The scale in the product's float32 epilogue and softmax on the bf16 scores (it accumulates
    # in float32): three passes over [n, heads, top_k] instead of six.
    s = q.new_empty(q.shape[0], q.shape[1], kv.shape[1])
    s = torch.baddbmm(s, q, kv.transpose(1, 2), beta=0.0, alpha=scale)
    return torch.bmm(torch.softmax(s, dim=-1), kv[..., : cfg.latent])


def attn_out(cfg: GraphConfig, w: dict, mix: torch.Tensor) -> torch.Tensor:
    """Latent mix [n, heads, latent] -> W_UV per head -> output projection [n, hidden]."""
    n = mix.shape[0]
    v = torch.bmm(mix.transpose(0, 1), w["w_uv"]).transpose(0, 1)  # [n, heads, v_head]
    return v.reshape(n, cfg.heads * cfg.v_head) @ w["o"]


def mlp(cfg: GraphConfig, w: dict, h: torch.Tensor) -> torch.Tensor:
    g = rms_norm(h, w["mlp_norm"]) @ w["w13"]
    act = torch.nn.functional.silu(g[:, : cfg.mlp_inter]) * g[:, cfg.mlp_inter :]
    return act @ w["w2"]
