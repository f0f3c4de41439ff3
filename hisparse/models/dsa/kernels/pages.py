"""Keys to device rows through a page table, one Triton launch: hybrid residency's translation
of the selected keys of resident requests (``hisparse.engine.dsa.hybrid``).

Why: in torch it is eight elementwise launches per layer (clamp, shift, gather, multiply, mask,
add, compare, select), a few microseconds each of a captured decode step whatever the batch;
resident mode reads its keys as rows and pays none of them.

A key is ``slot * context + position`` with ``context`` a multiple of ``block``, so its page
table entry is ``table.view(-1)[key // block]`` and its row ``page * block + key % block``;
negative keys (no selection) stay as they are. ``page_rows_torch`` is the reference (the CPU
path and the tests' oracle); the kernel equals it exactly (integer arithmetic only).
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.kernels.rows import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _page_rows(keys, table, out, n, BLOCK: tl.constexpr, SHIFT: tl.constexpr, N: tl.constexpr):
        i = tl.program_id(0) * N + tl.arange(0, N)
        ok = i < n
        k = tl.load(keys + i, mask=ok, other=-1).to(tl.int64)
        live = k >= 0
        page = tl.load(table + (k >> SHIFT), mask=ok & live, other=0).to(tl.int64)
        rows = page * BLOCK + (k & (BLOCK - 1))
        tl.store(out + i, tl.where(live, rows, k), mask=ok)


def check_table(table: torch.Tensor, context: int, block: int) -> None:
    """One-line errors for a page table the translation can read."""
    if block < 1 or block & (block - 1):
        raise ValueError(f"block must be a power of two, got {block}")
    if context % block:
        raise ValueError(f"context ({context}) must be a multiple of block ({block})")
    if table.dim() != 2 or table.shape[1] != context // block or not table.is_contiguous():
        raise ValueError(
            f"page table must be contiguous [slots, {context // block}], got {tuple(table.shape)}"
        )


def page_rows_torch(keys: torch.Tensor, table: torch.Tensor, block: int) -> torch.Tensor:
    """Device rows of ``keys`` (int64, any shape) through ``table`` [slots, pages]; -1 stays."""
    k = keys.clamp(min=0)
    page = table.view(-1)[torch.div(k, block, rounding_mode="floor")].to(torch.int64)
    return torch.where(keys >= 0, page * block + k.remainder(block), keys)


def page_rows(keys: torch.Tensor, table: torch.Tensor, block: int) -> torch.Tensor:
    """``page_rows_torch`` in one launch on CUDA (Triton), the reference elsewhere."""
    if triton is None or keys.device.type != "cuda" or keys.dtype != torch.int64:
        return page_rows_torch(keys, table, block)
    k = keys.contiguous()
    out = torch.empty_like(k)
    n = k.numel()
    if n:
        N = 1024
        _page_rows[(triton.cdiv(n, N),)](k, table, out, n, block, block.bit_length() - 1, N)
    return out
