"""The rest of a DeepSeek-V3.2 / GLM-5 decoder in pure torch (float32, any device): what the
vLLM classes take from vLLM's own layers, written once for the DSA engine.

* ``DecoderSpec.from_hf``: the config fields beyond ``DSAConfig`` (norm eps, vocabulary, which
  layers are dense, MoE routing), checked by ``hisparse.models.dsa.schema``;
* ``rms_norm``; ``Rotary`` (default or YaRN frequencies and cos/sin scaling as transformers
  computes them) with ``rope_interleaved`` (MLA; GLM-5's indexer) and ``rope_half`` (DeepSeek-
  V3.2's indexer);
* ``mlp`` (dense SiLU-gated MLP) and ``moe`` (sigmoid scores + correction bias, grouped top-k,
  normalised and scaled weights, shared experts).

Weights are plain dicts of tensors keyed by the suffix of the checkpoint's tensor names
(``gate_proj.weight``...), so the same functions serve every layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Tuple

import torch

from hisparse.models.dsa import schema
from hisparse.models.dsa.config import DSAConfig

#: The MLA and query-latent norms: transformers builds them with its RMSNorm default eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DecoderSpec:
    """Config fields of the decoder around the sparse attention."""

    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    dense: Tuple[bool, ...]  # per layer: dense MLP (else MoE)
    n_experts: int
    experts_per_token: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    tie_embeddings: bool

    @staticmethod
    def from_hf(hf: Any, cfg: DSAConfig) -> "DecoderSpec":
        """The fields of a dict or config object, checked against ``schema`` (as
        ``DSAConfig.from_hf`` checks them) with transformers' defaults for ``cfg.arch``."""
        a, layers = cfg.arch, cfg.num_layers
        schema.validate(hf, a)
        types = schema.layer_list(hf, "mlp_layer_types", ("dense", "sparse"), layers)
        if types is None:  # transformers' rule when the list is not written out
            k = min(schema.get(hf, "first_k_dense_replace"), layers)
            types = ("dense",) * k + ("sparse",) * (layers - k)
        return DecoderSpec(
            vocab_size=schema.need(hf, "vocab_size"),
            rms_norm_eps=schema.need(hf, "rms_norm_eps", a),
            max_positions=schema.need(hf, "max_position_embeddings"),
            dense=tuple(t == "dense" for t in types),
            n_experts=schema.need(hf, schema.experts_key(hf)),
            experts_per_token=schema.need(hf, "num_experts_per_tok"),
            n_group=schema.need(hf, "n_group", a),
            topk_group=schema.need(hf, "topk_group", a),
            norm_topk_prob=schema.get(hf, "norm_topk_prob"),
            routed_scaling_factor=schema.get(hf, "routed_scaling_factor"),
            tie_embeddings=schema.get(hf, "tie_word_embeddings"),
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: dict, base: float, max_positions: int, dim: int) -> Tuple[torch.Tensor, float]:
    """YaRN inverse frequencies of ``dim`` rotary values and the cos/sin scale, as
    transformers' ``_compute_yarn_parameters``."""
    factor = rope["factor"]  # schema.rope checked it and made it a float
    orig = rope.get("original_max_position_embeddings") or max_positions
    scale = rope.get("attention_factor")
    if scale is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        scale = (
            _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
            if m and m_all
            else _yarn_mscale(factor)
        )
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def corr(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr(fast), corr(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(scale)


class Rotary:
    """cos / sin of the ``qk_rope_head_dim`` rotary values at given positions
    (``cat(freqs, freqs)`` layout)."""

    def __init__(self, cfg: DSAConfig, max_positions: int, device: torch.device) -> None:
        rope = cfg.rope_parameters()
        base = rope["rope_theta"]
        dim = cfg.qk_rope_head_dim
        if rope["rope_type"] == "yarn":
            inv, self.scale = _yarn(rope, base, max_positions, dim)
        else:
            inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
            self.scale = 1.0
        self.inv_freq = inv.to(device)

    def __call__(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.scale, emb.sin() * self.scale


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., 64] with pairs (x0, x1), (x2, x3)... rotated; the result is laid out as
    transformers lays it out (rotated evens, then rotated odds), which is what it caches."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1] // 2,)
    c, s = cos[:, : cos.shape[-1] // 2].reshape(shape), sin[:, : sin.shape[-1] // 2].reshape(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., 64] rotated half-split (``rotate_half``)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * c + rotated * s


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


def mlp(x: torch.Tensor, w: Mapping[str, torch.Tensor], prefix: str = "") -> torch.Tensor:
    """SiLU-gated MLP with ``{prefix}gate_proj.weight`` / ``up_proj`` / ``down_proj``."""
    gate = linear(x, w[f"{prefix}gate_proj.weight"])
    up = linear(x, w[f"{prefix}up_proj.weight"])
    return linear(torch.nn.functional.silu(gate) * up, w[f"{prefix}down_proj.weight"])


def route(x: torch.Tensor, w: Mapping[str, torch.Tensor], spec: DecoderSpec):
    """(weights [T, k], expert ids [T, k]): sigmoid scores, the correction bias only for the
    choice, the best ``topk_group`` groups by their two best scores, then the best experts."""
    scores = linear(x.float(), w["gate.weight"].float()).sigmoid()
    choice = scores + w["gate.e_score_correction_bias"].float()
    g, per = spec.n_group, spec.n_experts // spec.n_group
    group_scores = choice.view(-1, g, per).topk(min(2, per), dim=-1)[0].sum(dim=-1)
    groups = group_scores.topk(spec.topk_group, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
    keep = keep.unsqueeze(-1).expand(-1, g, per).reshape(-1, spec.n_experts)
    choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(spec.experts_per_token, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, ids


def moe(
    x: torch.Tensor, w: Mapping[str, torch.Tensor], spec: DecoderSpec, *, dense: bool = False
) -> torch.Tensor:
    """Routed experts (``experts.{e}.*``) plus the shared experts (``shared_experts.*``).
    ``dense``: every expert over every token, weighted by its routing weight (0 where it was not
    chosen): no host read of the chosen ids, so a CUDA graph captures it; the work of all the
    experts, which only a small checkpoint affords."""
    weights, ids = route(x, w, spec)
    out = torch.zeros_like(x)
    if dense:
        for e in range(spec.n_experts):
            share = torch.where(ids == e, weights, torch.zeros_like(weights)).sum(dim=-1)
            out = out + mlp(x, w, f"experts.{e}.") * share[:, None].to(x.dtype)
        return out + mlp(x, w, "shared_experts.")
    for e in ids.unique().tolist():
        tok, slot = torch.where(ids == e)
        y = mlp(x[tok], w, f"experts.{e}.") * weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out + mlp(x, w, "shared_experts.")
