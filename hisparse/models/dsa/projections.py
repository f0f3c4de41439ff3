"""The projections around one DSA layer's sparse attention, in pure torch (float32, any device):
the MLA query and latent row of each token, the indexer's query / key / head weights, the sorted
top-k a query attends to, and the attention output over the rows it read. With ``kernels=True``
on CUDA the norms and rotary embeddings run as ``hisparse.models.dsa.kernels.elementwise`` (one
launch each, the rotations in place on the projections' outputs, the same values up to a norm's
sum order).

Weights are the layer's ``self_attn.*`` tensors keyed by their suffix (``q_a_proj.weight``,
``indexer.wq_b.weight``...), as transformers names them. The row math itself is
``hisparse.models.dsa.attention`` and the indexer's scoring ``hisparse.models.dsa.indexer``.
"""

from __future__ import annotations

from typing import Mapping, Tuple

import torch

from hisparse.models.dsa import attention as mla
from hisparse.models.dsa import indexer as dsa_index
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.decoder import (
    LATENT_NORM_EPS,
    linear,
    rms_norm,
    rope_half,
    rope_interleaved,
)
from hisparse.models.dsa.kernels import elementwise as ew

Weights = Mapping[str, torch.Tensor]
CosSin = Tuple[torch.Tensor, torch.Tensor]


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, kernels=False) -> torch.Tensor:
    """``decoder.rms_norm`` of x [T, N] (one launch on the kernel path)."""
    if kernels and ew.supported(x, weight):
        return ew.rms_norm(x, weight, eps)
    return rms_norm(x, weight, eps)


def mla_row(h: torch.Tensor, w: Weights, cfg: DSAConfig, rope: CosSin, *, kernels=False):
    """(q_resid [T, q_lora_rank], row values [T, 576]): what the indexer and the row store need
    before the selection."""
    cos, sin = rope
    norms = w["q_a_layernorm.weight"], w["kv_a_layernorm.weight"]
    if kernels and ew.supported(h, cos, sin, *norms):
        q_resid = ew.rms_norm(linear(h, w["q_a_proj.weight"]), norms[0], LATENT_NORM_EPS)
        kv = linear(h, w["kv_a_proj_with_mqa.weight"])
        return q_resid, ew.latent_row(kv, norms[1], LATENT_NORM_EPS, cos, sin)
    q_resid = rms_norm(linear(h, w["q_a_proj.weight"]), norms[0], LATENT_NORM_EPS)
    kv = linear(h, w["kv_a_proj_with_mqa.weight"])
    c = cfg.kv_lora_rank
    latent = rms_norm(kv[:, :c], norms[1], LATENT_NORM_EPS)
    return q_resid, mla.latent_row(latent, rope_interleaved(kv[:, c:], cos, sin))


def mla_query(q_resid: torch.Tensor, w: Weights, cfg: DSAConfig, rope: CosSin, *, kernels=False):
    """(q_nope [T, H, nope], q_pe [T, H, 64]): the query heads. Only attention reads them, so a
    HiSparse step computes them while the layer's misses copy in."""
    t, nope = q_resid.shape[0], cfg.qk_nope_head_dim
    cos, sin = rope
    q = linear(q_resid, w["q_b_proj.weight"]).view(t, cfg.num_heads, -1)
    if kernels and ew.supported(q, cos, sin):
        q = ew.rope_(q, cos, sin, start=nope, interleaved=True)
        return q[..., :nope], q[..., nope:]
    return q[..., :nope], rope_interleaved(q[..., nope:], cos, sin)


def index_inputs(
    h: torch.Tensor, q_resid: torch.Tensor, w: Weights, cfg: DSAConfig, rope: CosSin, *,
    kernels=False,
):  # fmt: skip
    """The indexer's (queries [T, Hi, D], keys [T, D], head weights [T, Hi]) of new tokens."""
    t, d = h.shape[0], cfg.index_head_dim
    q = linear(q_resid, w["indexer.wq_b.weight"]).view(t, cfg.index_n_heads, d)
    k = linear(h, w["indexer.wk.weight"])
    k = dsa_index.normalise_key(k, w["indexer.k_norm.weight"], w["indexer.k_norm.bias"])
    cos, sin = rope
    if kernels and ew.supported(q, k, cos, sin):
        turn = dict(cos=cos, sin=sin, start=0, interleaved=cfg.indexer_rope_interleave)
        q, k = ew.rope_(q, **turn), ew.rope_(k.view(t, 1, d), **turn).view(t, d)
        return q, k, linear(h, w["indexer.weights_proj.weight"])
    turn = rope_interleaved if cfg.indexer_rope_interleave else rope_half
    r = cfg.qk_rope_head_dim
    q = torch.cat([turn(q[..., :r], cos, sin), q[..., r:]], dim=-1)
    k = torch.cat([turn(k[:, :r], cos, sin), k[:, r:]], dim=-1)
    return q, k, linear(h, w["indexer.weights_proj.weight"])


def select_sorted(
    q: torch.Tensor,
    head_w: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    cfg: DSAConfig,
) -> torch.Tensor:
    """Positions each query attends to, int64 [T, index_topk], ascending, -1 padding last
    (``indexer.sorted_positions``). ``keys`` [N, D]: the index keys of positions 0..N-1."""
    scores = dsa_index.index_scores(q, head_w, keys, cfg)
    key_pos = torch.arange(keys.shape[0], device=keys.device)
    sel = dsa_index.causal_top_k(scores, key_pos, positions, cfg.index_topk)
    return dsa_index.sorted_positions(sel, cfg.index_topk)


def attention_output(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    w: Weights,
    cfg: DSAConfig,
) -> torch.Tensor:
    """o_proj of the attention over each query's rows (values [T, K, 576], valid [T, K])."""
    kv_b = w["kv_b_proj.weight"]
    q_lat = mla.absorb_query(q_nope, kv_b, cfg)
    o = mla.attend_rows(q_lat, q_pe, values, valid, cfg.softmax_scale)
    return linear(mla.expand_values(o, kv_b, cfg), w["o_proj.weight"])
