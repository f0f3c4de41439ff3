"""The indexer's top-k in one Triton launch: each token's ``k`` best visible positions by radix
selection over the float bits of its scores, written in ascending position order.

Why: ``torch.topk`` of 2048 among 32k scores, then an int32 sort of the chosen positions, took
about 73 us per layer at batch 30 on an H200 (56 + 17; docs/results.md's profile), a cost paid
per request in both modes. Here one program per token finds the k-th largest score in four
passes of 8 bits over its row (a 256-bin histogram each, the row read from L2), then a fifth pass
keeps the positions above it, and the first positions equal to it, in position order: no sort.

Which positions are chosen: every score above the k-th largest, then among scores equal to it
the lowest positions; -inf (a position past the token's own) is never chosen. Both modes run the
same selection, so their parity does not depend on how ties are broken.
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.kernels.rows import triton

PAD = 2147483647  # int32's largest: after every position, as select.py's sort keys

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _orderable(x):
        """float32 -> uint32 keys in the same order (larger float, larger key; -0.0 = 0.0)."""
        b = tl.where(x == 0.0, 0.0, x).to(tl.uint32, bitcast=True)
        neg = (b >> 31) == 1
        return tl.where(neg, ~b, b | 0x80000000)

    @triton.jit
    def _radix_top_k(
        scores, out, L, K, TOP_K: tl.constexpr, BLOCK: tl.constexpr, OUT_BLOCK: tl.constexpr
    ):
        t = tl.program_id(0).to(tl.int64)
        row = scores + t * L
        bins = tl.arange(0, 512)
        prefix = tl.zeros([], tl.uint32)  # the k-th key's bits found so far
        above = tl.zeros([], tl.int32)  # positions whose key is above the prefix's range
        need = K
        for p in tl.static_range(4):
            shift: tl.constexpr = 24 - 8 * p
            hist = tl.zeros([512], tl.int32)
            for s in range(0, L, BLOCK):
                j = s + tl.arange(0, BLOCK)
                x = tl.load(row + j, mask=j < L, other=float("-inf"))
                key = _orderable(x)
                ok = (j < L) & (x > float("-inf"))
                if p > 0:
                    ok = ok & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                # bins 256..511 take what is outside the range: one histogram, no mask
                digit = tl.where(ok, (key >> shift) & 0xFF, 256 + (j & 255))
                hist += tl.histogram(digit.to(tl.int32), 512)
            hist = tl.where(bins < 256, hist, 0)
            if p == 0:  # fewer visible positions than k: every one of them
                need = tl.minimum(K, tl.sum(hist))
            # suffix[d]: positions in range with digit >= d
            suffix = tl.sum(hist) - tl.cumsum(hist, 0) + hist
            fits = (bins < 256) & (above + suffix >= need)
            d = tl.max(tl.where(fits, bins, 0))
            above += tl.sum(tl.where(bins > d, hist, 0))
            prefix = prefix | (d.to(tl.uint32) << shift)
        # prefix is now the k-th largest key: keep the keys above it and the first equal ones
        equal_left = need - above
        taken = tl.zeros([], tl.int32)
        seen_equal = tl.zeros([], tl.int32)
        dst = out + t * TOP_K
        for s in range(0, L, BLOCK):
            j = s + tl.arange(0, BLOCK)
            x = tl.load(row + j, mask=j < L, other=float("-inf"))
            key = _orderable(x)
            ok = (j < L) & (x > float("-inf")) & (need > 0)
            eq = ok & (key == prefix)
            eq_rank = seen_equal + tl.cumsum(eq.to(tl.int32), 0) - eq.to(tl.int32)
            keep = ((ok & (key > prefix)) | (eq & (eq_rank < equal_left))) != 0
            at = taken + tl.cumsum(keep.to(tl.int32), 0) - keep.to(tl.int32)
            tl.store(dst + at, j.to(tl.int32), mask=keep)
            taken += tl.sum(keep.to(tl.int32))
            seen_equal += tl.sum(eq.to(tl.int32))
        for s in range(0, TOP_K, OUT_BLOCK):
            j = s + tl.arange(0, OUT_BLOCK)
            tl.store(dst + j, tl.full([OUT_BLOCK], PAD, tl.int32), mask=(j >= taken) & (j < TOP_K))


def top_k_positions(scores: torch.Tensor, k: int, top_k: int, *, block: int = 2048, warps: int = 8):
    """Scores float32 [T, L] (-inf: not visible) -> int32 [T, top_k]: each row's ``k`` (<=
    ``top_k``) best visible positions, ascending, then ``PAD``."""
    if scores.dtype != torch.float32 or scores.dim() != 2:
        raise ValueError(f"scores must be float32 [T, L], got {scores.dtype} {tuple(scores.shape)}")
    T, L = scores.shape
    if not 0 <= k <= top_k:
        raise ValueError(f"need 0 <= k <= top_k, got k={k} top_k={top_k}")
    out = torch.empty(T, top_k, dtype=torch.int32, device=scores.device)
    if T == 0:
        return out
    out_block = min(triton.next_power_of_2(top_k), 4096)
    _radix_top_k[(T,)](scores.contiguous(), out, L, k, top_k, block, out_block, num_warps=warps)
    return out
