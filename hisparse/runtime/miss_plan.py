"""A layer's misses left to attention's row read, which fetches them from the host pool itself
(``hisparse.models.dsa.kernels.misses``), instead of a gather copying them into the hot buffer
first. ``defer_misses`` does what ``HiSparseRuntime.gather`` does except the copy: the moved
bytes are counted the same, and the caller's stream is ordered after the layer's saves and the
group's resolve (so a row saved this step is already in the pool when the read fetches it)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from hisparse.runtime.index_group import HiSparseIndexGroup, HiSparseRuntime


@dataclass(frozen=True)
class MissPlan:
    """What the read needs: the host rows (uint8 [N, row_bytes], pinned on CUDA), the group's
    ``pending`` table (int32, one entry per hot row, -1 where nothing is pending) and the
    resolve op's plan (miss_src, miss_dst int32 [B, K], miss_count int32 [B])."""

    host: torch.Tensor
    pending: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor
    count: torch.Tensor


_PENDING: "weakref.WeakKeyDictionary[HiSparseIndexGroup, torch.Tensor]" = (
    weakref.WeakKeyDictionary()
)


def pending_table(group: HiSparseIndexGroup) -> torch.Tensor:
    """The group's table, all -1 between reads (made at first use: only the in-read needs it)."""
    t = _PENDING.get(group)
    if t is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"index group {group.name!r}: the in-read's table is made by an eager step, "
                "not inside a graph capture"
            )
        rows = group.hot_base + group.num_state_rows * group.hot_size
        t = _PENDING[group] = torch.full((rows,), -1, dtype=torch.int32, device=group.device)
    return t


def _count_only(host, hot, miss_src, miss_dst, miss_count) -> None:
    """The gather's copy, left to the read (``HiSparseRuntime.gather`` counts the bytes)."""


def defer_misses(rt: HiSparseRuntime) -> MissPlan:
    """This step's miss plan for layer ``rt``, its bytes counted as moved, the current stream
    ordered after the copy stream (this layer's saves, the resolve)."""
    rt.gather(copy=_count_only)
    rt.wait_ready()
    g = rt.index_group
    return MissPlan(rt.host_rows_view, pending_table(g), *g.plan())
