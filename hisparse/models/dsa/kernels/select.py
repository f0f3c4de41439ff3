"""From the indexer's scores to the slots attention reads, in one launch and no sort: each
token's ``top_k`` best visible scores by a radix select, then their slots in ascending position
order (-1 padding last).

One program per token. Scores become 32-bit keys that order as the floats do; four passes of an
8-bit histogram over the keys that share the bits found so far narrow down the exact key of the
top_k-th best score and how many of the keys equal to it are still needed. A last pass walks
the positions in ascending order and writes the slot of every key above that threshold and of
the first keys equal to it, so the output needs no sort: among equal scores the lowest
positions win, a rule that does not depend on the batch or the row's width.

Why: ``topk`` and an int32 sort of its positions cost 66 us per layer at batch 1 and 97 at
batch 64 on an H200 over 32k keys (docs/results.md), most of it fixed cost of the sort's
passes and launches; each pass here reads the token's visible scores once, from L2 after the
first.
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.kernels.rows import triton

if triton is not None:
    import triton.language as tl

    # 8-bit digits; bins past them take masked elements, so the histogram needs no mask.
    _RADIX = tl.constexpr(256)

    @triton.jit
    def _keys(row, c, n, BLOCK: tl.constexpr):
        """Keys (uint32, float order) of columns c..c+BLOCK of ``row``; 0 where not visible."""
        j = c + tl.arange(0, BLOCK)
        x = tl.load(row + j, mask=j < n, other=float("-inf"))
        x = tl.where(x == 0.0, 0.0, x)  # -0.0 and 0.0 are one score: one key
        bits = x.to(tl.uint32, bitcast=True)
        neg = (bits >> 31) != 0
        key = tl.where(neg, ~bits, bits | 0x80000000)
        return j, tl.where(x > float("-inf"), key, 0)

    @triton.jit
    def _digits(row, n, prefix, shift: tl.constexpr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
        """Histogram [2 * _RADIX] of the 8-bit digit at ``shift`` of the visible keys whose
        higher bits are ``prefix`` (all visible keys when FIRST); bins >= _RADIX are zero."""
        hist = tl.zeros((2 * _RADIX,), tl.int32)
        for c in range(0, n, BLOCK):
            _, key = _keys(row, c, n, BLOCK)
            live = key != 0
            if not FIRST:
                live = live & ((key >> (shift + 8)) == prefix)
            digit = tl.where(live, (key >> shift) & 0xFF, 2 * _RADIX - 1)
            hist += tl.histogram(digit.to(tl.int32), 2 * _RADIX)
        return tl.where(tl.arange(0, 2 * _RADIX) < _RADIX, hist, 0)

    @triton.jit
    def _top_k_slots(
        scores, s_stride, positions, req, block_table, bt_stride, out, N,
        BS: tl.constexpr, TOP_K: tl.constexpr, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        row = scores + t * s_stride
        n = tl.minimum(N, tl.load(positions + t).to(tl.int32) + 1)  # the columns it may see
        bins = tl.arange(0, 2 * _RADIX)
        # Threshold key found so far (its high bits) and how many keys equal to it to take.
        prefix = tl.zeros((), tl.uint32)
        need = tl.full((), TOP_K, tl.int32)
        hist = _digits(row, n, prefix, 24, True, BLOCK)
        visible = tl.sum(hist)
        if visible <= TOP_K:  # no more visible keys than top_k: every one of them
            need = need * 0
        for p in tl.static_range(4):
            if p > 0:
                if visible > TOP_K:
                    hist = _digits(row, n, prefix, 24 - 8 * p, False, BLOCK)
            if visible > TOP_K:
                at_least = tl.cumsum(hist, 0, reverse=True)  # keys with digit >= bin
                d = tl.sum((at_least >= need).to(tl.int32)) - 1
                need -= tl.sum(tl.where(bins > d, hist, 0))
                prefix = (prefix << 8) | d.to(tl.uint32)
        # prefix: the threshold key (0 where every visible key is taken: all are above it).
        r = tl.load(req + t).to(tl.int64)
        taken = tl.zeros((), tl.int32)
        equal_seen = tl.zeros((), tl.int32)
        for c in range(0, n, BLOCK):
            j, key = _keys(row, c, n, BLOCK)
            eq = (key == prefix) & (key != 0)
            eq_rank = equal_seen + tl.cumsum(eq.to(tl.int32), 0) - 1
            sel = (key > prefix) | (eq & (eq_rank < need))
            at = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
            blk = tl.load(block_table + r * bt_stride + j // BS, mask=sel, other=0).to(tl.int64)
            tl.store(out + t * TOP_K + at, blk * BS + j % BS, mask=sel)
            taken += tl.sum(sel.to(tl.int32))
            equal_seen += tl.sum(eq.to(tl.int32))
        k = tl.arange(0, OUT_BLOCK)
        pad = (k >= taken) & (k < TOP_K)
        tl.store(out + t * TOP_K + k, tl.full((OUT_BLOCK,), -1, tl.int64), mask=pad)


def top_k_slots(
    scores: torch.Tensor,
    positions: torch.Tensor,
    req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    top_k: int,
) -> torch.Tensor:
    """Index ``scores`` (float32 [T, N], column j the score of the key at position j; -inf, or
    a column past the token's position, is not visible) -> slots int64 [T, top_k] of each
    token's ``top_k`` best visible keys (the lowest positions among equal scores), in ascending
    position order, -1 padding last. Position j of token t's request ``req[t]`` is slot
    ``block_table[req[t], j // block_size] * block_size + j % block_size``."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32 [T, N], got {scores.dtype} {tuple(scores.shape)}")
    T, N = scores.shape
    if positions.shape != (T,) or req.shape != (T,):
        raise ValueError(f"positions and req must be [{T}], got {positions.shape} {req.shape}")
    out = torch.empty(T, top_k, dtype=torch.int64, device=scores.device)
    if T == 0:
        return out
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    bt = block_table.contiguous()
    _top_k_slots[(T,)](
        scores, scores.stride(0), positions.contiguous(), req.contiguous(), bt, bt.stride(0),
        out, N, block_size, top_k, 2048, triton.next_power_of_2(top_k), num_warps=8,
    )  # fmt: skip
    return out
