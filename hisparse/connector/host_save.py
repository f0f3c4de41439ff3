"""Writing one layer's new KV rows of a step into the host pool at their slots (keys).

Every row a layer computes is saved: the host pool is the full KV, and a later step's gather
copies misses from it into the hot buffers.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from hisparse.ops.limits import INT32_MAX
from hisparse.runtime import HiSparseRuntime, streams

SlotMapping = Union[Sequence[int], torch.Tensor]


def save_kv_rows(
    rt: HiSparseRuntime, kv_rows: torch.Tensor, slot_mapping: SlotMapping, host_rows: int
) -> None:
    """Write ``kv_rows`` of layer ``rt`` at ``slot_mapping`` (slots < 0 are padding, skipped).
    ``slot_mapping``: a list, a CPU tensor, or (CUDA) a tensor on the rows' device, used there
    without a host sync. ``host_rows``: the pool's rows, for the bound check of CPU slots."""
    name = rt.layer_name
    if not isinstance(kv_rows, torch.Tensor):
        raise ValueError(f"kv_layer must be a tensor, got {type(kv_rows).__name__}")
    slots = _slots(slot_mapping, kv_rows.device)
    rows = _rows(name, kv_rows, rt.row_bytes)
    if rows.shape[0] != slots.numel():
        raise ValueError(
            f"kv_layer of {name!r} has {rows.shape[0]} rows but slot_mapping has "
            f"{slots.numel()} entries"
        )
    if slots.device.type == "cpu" and slots.numel():
        lo, hi = slots.aminmax()  # one pass: the bound check and padding
        lo, hi = int(lo), int(hi)
        if hi >= host_rows:
            _refuse_slot(name, hi, host_rows)
    if rows.device.type == "cpu":
        if slots.numel() and lo < 0:  # padding slots are skipped
            keep = slots >= 0
            rows, slots = rows[keep], slots[keep]
        if slots.numel():
            rt.host_rows_view.index_copy_(0, slots, rows)
        return
    if slots.numel():
        _save_cuda(rt, rows, slots)


def _refuse_slot(name: str, slot: int, host_rows: int) -> None:
    """A slot past the pool. Past int32 it is no key at all (keys, hence slots, are int32 and
    no pool holds more rows), so a larger pool would not help: the slot mapping is wrong."""
    if slot > INT32_MAX:
        raise ValueError(
            f"slot_mapping of {name!r} holds slot {slot}, which is no valid key (keys are int32, "
            f"at most {INT32_MAX}): the slot mapping is wrong, not the pool size"
        )
    raise ValueError(
        f"slot_mapping of {name!r} holds slot {slot}, outside the host pool's {host_rows} "
        "rows: raise kv_connector_extra_config['host_pool_gib']"
    )


def _slots(slot_mapping: SlotMapping, rows_device: torch.device) -> torch.Tensor:
    """Flat int64 slots, on the CPU or on the rows' device."""
    if not isinstance(slot_mapping, torch.Tensor):
        return torch.as_tensor(list(slot_mapping), dtype=torch.int64)
    dev = slot_mapping.device
    if dev.type not in ("cpu", rows_device.type) or (dev.type != "cpu" and dev != rows_device):
        raise ValueError(
            f"slot_mapping is on {dev}; it must be on the CPU or on the rows' device {rows_device}"
        )
    return slot_mapping.reshape(-1).to(torch.int64)


def _rows(name: str, kv_rows: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``kv_rows`` as uint8 [n, row_bytes]."""
    if not kv_rows.is_contiguous():
        kv_rows = kv_rows.contiguous()
    b = kv_rows.view(torch.uint8) if kv_rows.dtype != torch.uint8 else kv_rows
    if b.numel() % row_bytes:
        raise ValueError(f"kv_layer of {name!r} is not a whole number of {row_bytes}-byte rows")
    return b.reshape(-1, row_bytes)


def _save_cuda(rt: HiSparseRuntime, rows: torch.Tensor, slots: torch.Tensor) -> None:
    # One launch on the group's copy stream, after the compute that produced the rows (later
    # gathers run on that stream too); the kernel writes pinned host rows directly.
    dev = rows.device
    if slots.device.type == "cpu":
        slots = slots.to(torch.int32).pin_memory().to(dev, non_blocking=True)
    else:
        slots = slots.to(torch.int32)
    g = rt.index_group
    stream = g.copy_stream
    streams.wait_for(stream, streams.current(dev), g.computed)
    with streams.on_stream(stream):
        g.save_op([rows], [rt.host_view], _iota(rows.shape[0], dev), slots, None)
    rows.record_stream(stream)
    slots.record_stream(stream)


_IOTA: dict = {}  # device -> [0, 1, ...] int32, grown by doubling; older ones kept alive


def _iota(n: int, device: torch.device) -> torch.Tensor:
    """[0, n) int32 on ``device`` without a launch per call (a cached buffer's prefix). A
    grown buffer keeps the smaller ones alive: copies queued on other streams may still read
    them."""
    have = _IOTA.setdefault(device, [])
    if not have or have[-1].numel() < n:
        if torch.cuda.is_current_stream_capturing():  # its values would exist in replays only
            return torch.arange(n, dtype=torch.int32, device=device)
        size = max(n, 2 * have[-1].numel() if have else 4096)
        have.append(torch.arange(size, dtype=torch.int32, device=device))
    return have[-1][:n]
