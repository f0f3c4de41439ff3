"""The DSA indexer (DeepSeek-V3.2 / GLM-5 "lightning indexer"): which K earlier tokens each
query token attends to.

    score(t, j) = sum_h w_h(t) / sqrt(H) * relu(scale * q_h(t) . k(j))

with ``k = rope(layernorm(wk x))`` (one key per token, cached) and ``q = rope(wq_b q_resid)``;
the first ``qk_rope_head_dim`` values of each get the rotary embedding (the caller applies it:
interleaved for GLM-5, half-split for DeepSeek-V3.2). The released kernels add a Hadamard
rotation (orthogonal: same dot products) and FP8 keys (a precision choice); both are skipped.

API (tensors on any device):

* ``normalise_key(k, weight, bias)`` -> [T, D] (LayerNorm, eps 1e-6, before the rope);
* ``index_scores(q, w, keys, cfg)`` -> float32 [T, N] (q [T, H, D], w [T, H], keys [N, D]);
* ``causal_top_k(scores, key_pos, query_pos, top_k)`` -> int64 [T, min(top_k, N)] indices
  into the N keys, -1 where fewer than top_k keys are visible;
* ``sorted_positions(pos, top_k)`` -> [T, top_k]: those ascending, -1 padding last.
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.config import DSAConfig

KEY_NORM_EPS = 1e-6
# Larger than any position: sorts padding (-1) after every selected position.
_PAD_SORT = torch.iinfo(torch.int64).max


def normalise_key(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(k, (k.shape[-1],), weight, bias, KEY_NORM_EPS)


def index_scores(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, cfg: DSAConfig
) -> torch.Tensor:
    """Index score of every (query token, key) pair, in float32 as the reference computes it."""
    logits = torch.einsum("thd,nd->thn", q.float(), keys.float()) * cfg.index_head_dim**-0.5
    weights = w.float() * cfg.index_n_heads**-0.5
    return torch.einsum("th,thn->tn", weights, torch.relu(logits))


def causal_top_k(
    scores: torch.Tensor, key_pos: torch.Tensor, query_pos: torch.Tensor, top_k: int
) -> torch.Tensor:
    """The top_k highest-scoring keys each query may see (key position <= query position)."""
    visible = key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)
    masked = scores.masked_fill(~visible, float("-inf"))
    k = min(top_k, scores.shape[-1])
    best, idx = masked.topk(k, dim=-1)
    return torch.where(torch.isfinite(best), idx, torch.full_like(idx, -1))


def sorted_positions(pos: torch.Tensor, top_k: int) -> torch.Tensor:
    """[T, <= top_k] positions (-1 padding anywhere) -> [T, top_k], ascending, -1 padding last.
    Attention sums over the rows in this order, so every store that reads the same rows gives
    the same bits whatever order the top-k returned them in."""
    pos = torch.nn.functional.pad(pos, (0, top_k - pos.shape[1]), value=-1)
    order = torch.where(pos >= 0, pos, torch.full_like(pos, _PAD_SORT)).sort(dim=-1).values
    return torch.where(order == _PAD_SORT, torch.full_like(order, -1), order)
