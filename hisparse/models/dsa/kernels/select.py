"""From the indexer's scores to the slots attention reads (``top_k_slots``): the extension's
``hisparse_topk_slots`` op wherever it is built for the scores' device (one launch: radix passes
over a cluster of CTAs per token, the selection written in position order; measured faster than
the path below from 1 to 512 tokens over 32k to 128k scores on an H200, docs/results.md), else
``torch.topk`` and ``selection_slots``: each token's chosen positions (padding past every
position) sorted in registers, then each sorted position's slot through the token's block table
(padding back to -1), in one launch.

Why: the torch form (a pad, two ``where``, an int64 sort, then ``TokenBatch.slots``' seven
elementwise passes) took about 60 us per layer at batch 30 on an H200; three launches around
torch's int32 sort took 29 us at batch 1 and at batch 64 over 32k keys, most of it the segmented
sort's launches and passes. A bitonic sort of one token's 2048 positions fits one program's
registers. The result is the same: ascending positions, -1 padding last, the same slots.
"""

from __future__ import annotations

import functools

import torch

from hisparse import ops
from hisparse.models.dsa.kernels.rows import triton
from hisparse.ops.extension import BackendUnavailableError

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _selection_slots(
        best, idx, req, block_table, out, k, bt_stride, BS: tl.constexpr, TOP_K: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        ok = j < k
        v = tl.load(best + t * k + j, mask=ok, other=float("-inf"))
        i = tl.load(idx + t * k + j, mask=ok, other=0)
        # -inf: a position past the token's own, or a column past those topk returned; its key
        # is int32's largest, which sorts after every position.
        p = tl.sort(tl.where(v > float("-inf"), i.to(tl.int32), 2147483647))
        valid = p != 2147483647
        r = tl.load(req + t).to(tl.int64)
        blk = tl.load(block_table + r * bt_stride + p // BS, mask=valid, other=0).to(tl.int64)
        slot = tl.where(valid, blk * BS + p % BS, -1)
        tl.store(out + t * TOP_K + j, slot, mask=j < TOP_K)


def selection_slots(
    best: torch.Tensor,
    idx: torch.Tensor,
    req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    top_k: int,
) -> torch.Tensor:
    """``topk``'s values ``best`` (float32 [T, k], -inf where nothing visible) and positions
    ``idx`` (int64 [T, k], k <= top_k) -> slots int64 [T, top_k]: ascending position order, -1
    padding last; position j of token t's request ``req[t]`` is slot ``block_table[req[t], j //
    block_size] * block_size + j % block_size``."""
    T, k = best.shape
    if idx.shape != best.shape or k > top_k:
        raise ValueError(f"best and idx must be [T, <= {top_k}], got {best.shape} {idx.shape}")
    out = torch.empty(T, top_k, dtype=torch.int64, device=best.device)
    if T == 0:
        return out
    bt = block_table.contiguous()
    _selection_slots[(T,)](
        best.contiguous(), idx.contiguous(), req.contiguous(), bt, out, k, bt.stride(0),
        block_size, top_k, triton.next_power_of_2(top_k), num_warps=8,
    )  # fmt: skip
    return out


def top_k_slots(
    scores: torch.Tensor,
    req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    top_k: int,
) -> torch.Tensor:
    """Slots int64 [T, top_k] of each token's ``top_k`` best scores (float32 [T, L], -inf where
    nothing is visible): ascending position order, -1 padding last, as ``selection_slots``."""
    op = _op(scores.device.type)
    if op is not None:
        out = torch.empty(scores.shape[0], top_k, dtype=torch.int64, device=scores.device)
        op(scores, req.contiguous(), block_table.contiguous(), block_size, out)
        return out
    # unsorted: the positions are sorted next; ranking the values too cost a sort
    best, idx = scores.topk(min(top_k, scores.shape[1]), dim=-1, sorted=False)
    return selection_slots(best, idx, req, block_table, block_size, top_k)


@functools.lru_cache(maxsize=None)
def _op(device_type: str):
    """The extension's op where it was built for ``device_type`` (CUDA), else None."""
    if device_type != "cuda":
        return None
    try:
        return ops.bound_op("hisparse_topk_slots", "cuda")
    except BackendUnavailableError:
        return None
