"""MLA over latent rows (DeepSeek-V3.2 / GLM-5), in the absorbed form a row cache needs.

A token's row is ``[rmsnorm(c_kv) (kv_lora_rank: 512) | rope(k_pe) (qk_rope_head_dim: 64)]``:
what ``kv_a_proj_with_mqa`` produces after the latent norm and rotary embedding, and exactly what
transformers caches.
Keys and values of head h are linear in the latent (``kv_b_proj``), so attention runs on rows:

    score(t, j) = scale * (q_nope_h W_uk_h . c_j + q_pe_h . k_pe_j)
    out_h(t)    = W_uv_h (sum_j softmax_j * c_j)

API (tensors on any device; the caller applies the rotary embedding to ``q_pe`` / ``k_pe``):

* ``latent_row(c_kv_normed, k_pe)`` -> [T, 576] row values;
* ``absorb_query(q_nope, kv_b_weight, cfg)`` -> [T, H, 512];
* ``attend_rows(q_latent, q_pe, rows, valid, scale)`` -> [T, H, 512] (rows [T, K, 576]);
* ``expand_values(o_latent, kv_b_weight, cfg)`` -> [T, H * v_head_dim] (input of ``o_proj``).
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.config import DSAConfig


def latent_row(c_kv_normed: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    """[T, 512] normalised latent and [T, 64] rotated rope key -> [T, 576] row values."""
    return torch.cat([c_kv_normed, k_pe], dim=-1)


def _split_kv_b(kv_b_weight: torch.Tensor, cfg: DSAConfig):
    """kv_b_proj weight [H * (nope + v), 512] -> W_uk [H, nope, 512], W_uv [H, v, 512]."""
    w = kv_b_weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]


def absorb_query(q_nope: torch.Tensor, kv_b_weight: torch.Tensor, cfg: DSAConfig) -> torch.Tensor:
    """[T, H, nope] -> the query in latent space [T, H, 512]."""
    w_uk, _ = _split_kv_b(kv_b_weight, cfg)
    return torch.einsum("thn,hnc->thc", q_nope, w_uk)


def attend_rows(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each query token over its own K gathered rows.

    q_latent [T, H, 512], q_pe [T, H, 64], rows [T, K, 576] (values), valid bool [T, K] (False:
    padding, ignored). Returns the attention-weighted latent [T, H, 512]; a token with no valid
    row gets zeros."""
    latent = rows[..., : q_latent.shape[-1]]
    scores = torch.einsum("thc,tkc->thk", q_latent, latent)
    scores = scores + torch.einsum("thr,tkr->thk", q_pe, rows[..., q_latent.shape[-1] :])
    scores = (scores * scale).float()
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(latent.dtype)
    return torch.einsum("thk,tkc->thc", probs, latent)


def expand_values(
    o_latent: torch.Tensor, kv_b_weight: torch.Tensor, cfg: DSAConfig
) -> torch.Tensor:
    """[T, H, 512] -> per-head values concatenated [T, H * v_head_dim]."""
    _, w_uv = _split_kv_b(kv_b_weight, cfg)
    return torch.einsum("thc,hvc->thv", o_latent, w_uv).reshape(o_latent.shape[0], -1)
