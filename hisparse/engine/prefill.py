"""A prompt's indexer selection and sparse attention, computed over all its positions at once
in chunks of rows, so a long prompt never materialises a [P, P] or [P, top_k, 576] tensor.
Both are identical in every mode: prefill reads the freshly computed rows, never the store."""

from __future__ import annotations

from typing import Callable, Tuple

import torch

from hisparse.models.reference import select_top_k
from hisparse.models.rows import LATENT_DIM

# Max elements of one prefill attention gather ([chunk, top_k, 576] values). Read at call time,
# so tests can shrink it to force chunking.
PREFILL_CHUNK_ELEMS = 1 << 25


def select_over_prompt(
    u: torch.Tensor,
    ik: torch.Tensor,
    pos: torch.Tensor,
    ema_weights: Callable[[int], Tuple[torch.Tensor, torch.Tensor]],
    top_k: int,
    recent: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The EMA query of every prompt position (carried from chunk to chunk) and its top-k.
    Returns (selection [P, top_k], the query after the last position)."""
    P = u.shape[0]
    n = max(1, min(P, PREFILL_CHUNK_ELEMS // max(1, P), 2048))
    ema, decay = ema_weights(n)
    prev = u[0]  # the state before position 0, so that q_0 = u_0
    sels = []
    for s in range(0, P, n):
        e = min(P, s + n)
        rows = e - s
        q = ema[:rows, :rows] @ u[s:e] + decay[:rows].unsqueeze(1) * prev
        prev = q[-1]
        sels.append(select_top_k(q @ ik.T, pos[s:e] + 1, top_k, recent))
    return torch.cat(sels), prev


def attend_over_prompt(
    q: torch.Tensor, vals: torch.Tensor, sel: torch.Tensor, scale: float
) -> torch.Tensor:
    """Sparse attention of every prompt position over its own selection, computed densely
    (scores against all prompt rows, unselected ones masked out): the same values as a
    gather, without materialising [P, top_k, 576]."""
    P = sel.shape[0]
    chunk = max(1, PREFILL_CHUNK_ELEMS // max(1, P))
    outs = []
    for s in range(0, P, chunk):
        sl = sel[s : s + chunk]
        mask = torch.zeros(sl.shape[0], P + 1, dtype=torch.bool, device=sel.device)
        mask.scatter_(1, torch.where(sl >= 0, sl, torch.full_like(sl, P)), True)
        sc = (q[s : s + chunk] @ vals.T) * scale
        sc = sc.masked_fill(~mask[:, :P], float("-inf"))
        outs.append(torch.softmax(sc, dim=-1) @ vals[:, :LATENT_DIM])
    return torch.cat(outs) if len(outs) > 1 else outs[0]
