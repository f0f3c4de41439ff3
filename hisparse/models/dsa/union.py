"""A decode of several query tokens (speculative decoding: the pending token and its drafts)
resolved through the hot buffers as one row per request: the union of its tokens' top-k. Used by
the vLLM classes (``hisparse.vllm.dsa.attention``) and the DSA engine's MTP verify steps
(``hisparse.engine.dsa.stores.HiSparseRows``).

The resolve keeps one hot copy per key of a state row, so the tokens of one request cannot be
resolved as separate rows of one step (they share the state row; a later row would evict what
an earlier one was given). Instead row r holds ``Q`` slices of ``K`` keys side by side, token j
of request r in slice j (-1 where a request has fewer than ``Q`` tokens); a key two tokens share
is resolved and counted once, and token j reads its own slice of the resolved row. Only device
tensors and shapes are read: no host sync, no loop over requests.
"""

from __future__ import annotations

from typing import Optional

import torch


def decode_token_rows(req: torch.Tensor, starts: torch.Tensor, q: int) -> Optional[torch.Tensor]:
    """Each decode token's slice in the union rows viewed as [R * q, K]: ``req * q + j`` for
    token j of its request. ``req``: int64 [T], each token's batch row; ``starts``: int [R + 1],
    the rows' first tokens (vLLM's ``query_start_loc``). None when ``q`` is 1: the tokens then
    are the rows and nothing is rearranged."""
    if q == 1:
        return None
    t = torch.arange(req.shape[0], device=req.device)
    return req * q + (t - starts.long()[req])


def union_rows(keys: torch.Tensor, at: Optional[torch.Tensor], rows: int, q: int) -> torch.Tensor:
    """int32 [rows, q * K]: the decode tokens' top-k ``keys`` [T, K] placed at ``at`` (from
    ``decode_token_rows``), -1 in the slices of tokens a request does not have."""
    k = keys.to(torch.int32)
    if at is None:
        return k
    out = k.new_full((rows * q, k.shape[1]), -1)
    out.index_copy_(0, at, k)
    return out.view(rows, q * k.shape[1])


def token_ids(resolved: torch.Tensor, at: Optional[torch.Tensor], q: int) -> torch.Tensor:
    """Each decode token's attention rows [T, K] out of the resolved union rows [R, q * K]."""
    if at is None:
        return resolved
    return resolved.reshape(resolved.shape[0] * q, -1)[at]
