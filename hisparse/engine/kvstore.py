"""Where the engine's KV rows live: all on the device (resident) or host pool + hot buffers
driven through the HiSparse connector (hisparse).

Both backends expose the same three calls to the forward pass: ``store`` (this step's new rows),
``read`` (the selected rows, as bytes, in selection order) and the step hooks. Attention decodes
whatever bytes ``read`` returns, so the two modes agree bit for bit exactly when the rows are
right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from hisparse.binding import PackedLayout, bind_layers, layer_view
from hisparse.engine.config import EngineConfig

BINDING_FAULTS = (None, "base_offset")


def packed_views(raw: torch.Tensor, layout: PackedLayout, binding_fault: Optional[str]) -> Dict[str, torch.Tensor]:
    """Per-layer views of one packed allocation; ``base_offset`` reproduces the upstream bug
    (every layer bound at the allocation's base offset, so later layers overwrite earlier ones)."""
    if binding_fault is None:
        return bind_layers(raw, layout)
    if binding_fault == "base_offset":
        return {name: layer_view(raw, layout, 0) for name in layout.layer_names}
    raise ValueError(f"binding_fault must be one of {BINDING_FAULTS}, got {binding_fault!r}")


def _flat(view: torch.Tensor) -> torch.Tensor:
    return view.reshape(-1, view.shape[-1])


@dataclass
class StepRows:
    """The rows a forward step writes into one layer."""
    rows: torch.Tensor          # uint8 [n, row_bytes] on the device
    keys: torch.Tensor          # int64 [n] on the device
    keys_cpu: torch.Tensor      # int64 [n] on the CPU (the slot mapping)
    window_rows: torch.Tensor   # int64 [w] device: device-window rows to write (hisparse)
    window_src: torch.Tensor    # int64 [w] device: which of ``rows`` goes there


class ResidentKV:
    """Every layer's full KV in one packed device allocation; attention reads rows by key."""

    mode = "resident"

    def __init__(self, cfg: EngineConfig, device: torch.device, binding_fault: Optional[str]) -> None:
        self.cfg = cfg
        names = cfg.layer_names()
        self.layout = PackedLayout(names, num_blocks=cfg.num_keys // cfg.block_size,
                                   block_size=cfg.block_size, row_bytes=cfg.row_bytes)
        self.raw = torch.zeros(self.layout.nbytes(), dtype=torch.uint8, device=device)
        views = packed_views(self.raw, self.layout, binding_fault)
        self.flat = [_flat(views[n]) for n in names]
        self.device_kv_bytes = self.raw.numel()
        self.host_pool_bytes = 0

    def begin_step(self, decode_ids: Sequence[str], prefill: Sequence[tuple], finished: Sequence[str]) -> None:
        pass

    def store(self, layer: int, new: StepRows) -> None:
        self.flat[layer].index_copy_(0, new.keys, new.rows)

    def read(self, layer: int, sel_keys: torch.Tensor, sel_pos: torch.Tensor, cur_pos: torch.Tensor,
             slots: torch.Tensor, num_prefill: int) -> torch.Tensor:
        return self.flat[layer][sel_keys.clamp(min=0)]

    def end_step(self):
        return None

    def finish(self, req) -> None:
        pass

    def close(self):
        return None


class _Req:
    """What the connector's scheduler side needs of a request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class _AttnMeta:
    def __init__(self, slot_mapping: torch.Tensor) -> None:
        self.slot_mapping = slot_mapping


class HiSparseKV:
    """Full KV in the connector's host pool; per layer a device buffer of ``max_running *
    window`` device-window rows (the newest tokens, served in place as resident hits) followed by
    ``max_running * hot_size`` hot rows. Drives HiSparseConnector in both roles."""

    mode = "hisparse"

    def __init__(self, cfg: EngineConfig, device: torch.device, binding_fault: Optional[str],
                 on_stats=None) -> None:
        from hisparse.connector import HiSparseConnector

        self.cfg = cfg
        self.window = max(1, cfg.recent_window)
        S, H, rb = cfg.num_state_rows, cfg.hot_size, cfg.row_bytes
        names = cfg.layer_names()
        self.names = names
        self.sum_row_bytes = rb * cfg.num_layers
        # Host rows: enough whole blocks for every key, plus one block of slack against rounding.
        host_rows = cfg.num_keys + cfg.block_size
        extra = {
            "host_pool_gib": host_rows * self.sum_row_bytes / 2**30,
            "top_k": cfg.top_k,
            "device_buffer_size": H,
            "index_share": cfg.index_share,
            "metrics_interval": cfg.metrics_interval,
            "max_num_seqs": S,
            "block_size": cfg.block_size,
        }
        self.extra_config = extra
        self.sched = HiSparseConnector.from_extra_config(extra, role="scheduler")
        self.worker = HiSparseConnector.from_extra_config(extra, role="worker")
        rows = S * self.window + S * H
        self.hot_base = S * self.window
        self.layout = PackedLayout(names, num_blocks=rows, block_size=1, row_bytes=rb)
        self.raw = torch.zeros(self.layout.nbytes(), dtype=torch.uint8, device=device)
        views = packed_views(self.raw, self.layout, binding_fault)
        self.flat = [_flat(views[n]) for n in names]
        self.worker.register_kv_caches({n: self.flat[i] for i, n in enumerate(names)})
        w = self.worker.worker
        if w is None or w.hot_base != self.hot_base:
            raise RuntimeError(f"connector hot_base {getattr(w, 'hot_base', None)} != engine's {self.hot_base}")
        self.host_pool_bytes = int(w.host_rows) * self.sum_row_bytes
        self.device_kv_bytes = self.raw.numel()
        self.on_stats = on_stats
        self._out_rows: Optional[torch.Tensor] = None
        self.closed = False

    def begin_step(self, decode_ids: Sequence[str], prefill: Sequence[tuple], finished: Sequence[str]) -> None:
        from hisparse.connector import StepSchedule

        sched = {rid: 1 for rid in decode_ids}
        for rid, n in prefill:
            sched[rid] = n
        out = StepSchedule(num_scheduled_tokens=sched, finished_req_ids=set(finished))
        meta = self.sched.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)

    def store(self, layer: int, new: StepRows) -> None:
        if new.window_rows.numel():
            self.flat[layer].index_copy_(0, new.window_rows, new.rows.index_select(0, new.window_src))
        self.worker.save_kv_layer(self.names[layer], new.rows, _AttnMeta(new.keys_cpu))

    def read(self, layer: int, sel_keys: torch.Tensor, sel_pos: torch.Tensor, cur_pos: torch.Tensor,
             slots: torch.Tensor, num_prefill: int) -> torch.Tensor:
        name = self.names[layer]
        B, K = sel_keys.shape
        if self.cfg.is_leader(layer):
            R = self.window
            in_win = (sel_pos >= 0) & (sel_pos > (cur_pos - R).unsqueeze(1))
            win_row = slots.unsqueeze(1) * R + sel_pos.remainder(R)
            resident = torch.where(in_win, win_row, torch.full_like(win_row, -1))
            top_k = sel_keys
            if num_prefill:
                pad = sel_keys.new_full((num_prefill, K), -1)
                top_k = torch.cat([top_k, pad])
                resident = torch.cat([resident, pad])
            self._top_k = top_k.to(torch.int32)
            self._resident = resident.to(torch.int32)
        out = self.worker.resolve(name, self._top_k, resident_rows=self._resident)
        self.worker.wait_for_layer_load(name)
        return self.flat[layer][out[:B].long().clamp(min=0)]

    def end_step(self):
        self.worker.wait_for_save()
        self.worker.clear_connector_metadata()
        stats = self.worker.get_kv_connector_stats()
        if stats is not None and self.on_stats is not None:
            self.on_stats(stats)
        return stats

    def finish(self, req_id: str) -> None:
        self.sched.request_finished(_Req(req_id), [])

    def close(self):
        """Drain every counter not yet reported, then shut the worker down."""
        if self.closed:
            return None
        self.closed = True
        stats = self.worker.worker.drain_stats()
        if stats is not None and self.on_stats is not None and not stats.is_empty():
            self.on_stats(stats)
        self.worker.shutdown()
        return stats
