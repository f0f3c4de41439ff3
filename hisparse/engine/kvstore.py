"""Where the engine's KV rows live. Every store implements ``KVStore``: the forward pass
``store``s each layer's new rows and ``read``s the selected rows back as bytes, in selection
order; attention decodes whatever bytes ``read`` returns, so the modes agree bit for bit exactly
when the rows are right.

- ``ResidentKV``: every row on the device.
- ``HiSparseKV`` (``hisparse/engine/hostkv.py``): every row in the connector's host pool, hot
  buffers on the device.
- ``HybridKV`` (``hisparse/engine/hybrid.py``): device pages while they last, the host pool for
  requests that spill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch

from hisparse.engine.config import EngineConfig
from hisparse.runtime.views import PackedLayout, bind_layers, layer_view

BINDING_FAULTS = (None, "base_offset")
# Negative control of the hybrid spill path: a spill copies one row too few to the host pool.
SPILL_FAULTS = (None, "off_by_one")


@dataclass
class StepRows:
    """The rows a forward step writes into one layer."""

    rows: torch.Tensor  # uint8 [n, row_bytes] on the device
    keys: torch.Tensor  # int64 [n] on the device
    keys_cpu: torch.Tensor  # int64 [n] on the CPU (the slot mapping)
    window_rows: torch.Tensor  # int64 [w] device: device-window rows to write (hisparse)
    window_src: torch.Tensor  # int64 [w] device: which of ``rows`` goes there


@runtime_checkable
class KVStore(Protocol):
    """What the engine needs of a KV store. Call order per step: ``begin_step``, then per layer
    ``store`` and (with decode rows) ``read``, then ``finish`` for each request that is done,
    then ``end_step``; ``close`` once at the end (idempotent).

    The store hands out state rows: ``begin_step`` sets ``slot`` of every new request (its keys
    are ``slot * max_context + position``), ``finish`` frees it. Where a connector holds every
    request (``HiSparseKV``) the rows are the connector's own; elsewhere a ``StateRows``."""

    mode: str
    window: int  # device-window rows per state row (1 where there is no window)
    device_kv_bytes: int  # device memory the store allocated for KV rows
    host_pool_bytes: int
    peak_spilled: int  # most requests spilled at once (hybrid; 0 otherwise)
    mid_request_spills: int  # spills of running requests (hybrid; 0 otherwise)

    def begin_step(self, dec: Sequence, new: Sequence, finished: Sequence[str]) -> None:
        """Before the step's forward: ``dec`` decode and ``new`` admitted requests, batch
        order; ``finished``: ids of the requests finished since the last step."""
        ...

    def store(self, layer: int, new: StepRows) -> None: ...

    def read(
        self,
        layer: int,
        sel_keys: torch.Tensor,
        sel_pos: torch.Tensor,
        cur_pos: torch.Tensor,
        slots: torch.Tensor,
        num_prefill: int,
    ) -> torch.Tensor:
        """The selected rows' bytes [B, top_k, row_bytes]; -1 entries of ``sel_keys`` are
        padding (any row may come back for them: attention masks them)."""
        ...

    def end_step(self): ...

    def finish(self, req) -> None: ...

    def close(self): ...


class StateRows:
    """State rows of a store without a connector holding every request: the lowest free row
    goes to the next request."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))

    def take(self) -> int:
        return self.free.pop(0)

    def give_back(self, row: int) -> None:
        self.free.append(row)
        self.free.sort()


def packed_views(
    raw: torch.Tensor, layout: PackedLayout, binding_fault: Optional[str]
) -> Dict[str, torch.Tensor]:
    """Per-layer views of one packed allocation; ``base_offset`` reproduces the upstream bug
    (every layer bound at the allocation's base offset, so later layers overwrite earlier ones)."""
    if binding_fault is None:
        return bind_layers(raw, layout)
    if binding_fault == "base_offset":
        return {name: layer_view(raw, layout, 0) for name in layout.layer_names}
    raise ValueError(f"binding_fault must be one of {BINDING_FAULTS}, got {binding_fault!r}")


def packed_rows(
    cfg: EngineConfig,
    rows_per_layer: int,
    block_size: int,
    device: torch.device,
    binding_fault: Optional[str],
) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """One packed device allocation for every layer and each layer's rows as a [rows, row_bytes]
    view of it."""
    names = cfg.layer_names()
    layout = PackedLayout(
        names,
        num_blocks=rows_per_layer // block_size,
        block_size=block_size,
        row_bytes=cfg.row_bytes,
    )
    raw = torch.zeros(layout.nbytes(), dtype=torch.uint8, device=device)
    views = packed_views(raw, layout, binding_fault)
    return raw, [views[n].reshape(-1, views[n].shape[-1]) for n in names]


class ResidentKV:
    """Every layer's full KV in one packed device allocation; attention reads rows by key."""

    mode = "resident"
    window = 1
    host_pool_bytes = 0
    peak_spilled = 0
    mid_request_spills = 0

    def __init__(
        self, cfg: EngineConfig, device: torch.device, binding_fault: Optional[str]
    ) -> None:
        self.cfg = cfg
        self.raw, self.flat = packed_rows(cfg, cfg.num_keys, cfg.block_size, device, binding_fault)
        self.device_kv_bytes = self.raw.numel()
        self.rows = StateRows(cfg.num_state_rows)

    def begin_step(self, dec: Sequence, new: Sequence, finished: Sequence[str]) -> None:
        for r in new:
            r.slot = self.rows.take()

    def store(self, layer: int, new: StepRows) -> None:
        self.flat[layer].index_copy_(0, new.keys, new.rows)

    def read(
        self,
        layer: int,
        sel_keys: torch.Tensor,
        sel_pos: torch.Tensor,
        cur_pos: torch.Tensor,
        slots: torch.Tensor,
        num_prefill: int,
    ) -> torch.Tensor:
        return self.flat[layer][sel_keys.clamp(min=0)]

    def end_step(self):
        return None

    def finish(self, req) -> None:
        self.rows.give_back(req.slot)

    def close(self):
        return None
