"""The always-host store: every row in the connector's host pool, hot buffers on the device;
the engine drives the connector in both roles, as vLLM does."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from hisparse.engine.config import EngineConfig
from hisparse.engine.kvstore import StepRows, packed_rows


def open_connector(cfg: EngineConfig, state_rows: int, flat: List[torch.Tensor], hot_base: int):
    """The connector in both roles, its worker bound to the per-layer device rows ``flat``,
    whose hot rows must start at ``hot_base``. Returns (scheduler role, worker role)."""
    from hisparse.connector import HiSparseConfig, HiSparseConnectorImpl

    rb, L, bs = cfg.row_bytes, cfg.num_layers, cfg.block_size
    config = HiSparseConfig(
        # enough whole blocks for every key, plus one block of slack against rounding
        host_pool_gib=(cfg.num_keys + bs) * rb * L / 2**30,
        top_k=cfg.top_k,
        hot_size=cfg.hot_size,
        index_share=cfg.index_share,
        metrics_interval=cfg.metrics_interval,
        max_num_seqs=state_rows,
        block_size=bs,
    )
    worker = HiSparseConnectorImpl(config, "worker")
    worker.register_kv_caches({n: flat[i] for i, n in enumerate(cfg.layer_names())})
    w = worker.worker
    if w is None or w.hot_base != hot_base:
        raise RuntimeError(
            f"connector hot_base {getattr(w, 'hot_base', None)} != engine's {hot_base}"
        )
    # The scheduler learns the pool the worker allocated, as vLLM's KV blocks tell it there.
    sched = HiSparseConnectorImpl(config, "scheduler", host_rows=w.host_rows)
    return sched, worker


class ConnectorRequest:
    """What the connector's scheduler side needs of a request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class _AttnMeta:
    def __init__(self, slot_mapping: torch.Tensor) -> None:
        self.slot_mapping = slot_mapping


class HiSparseKV:
    """Full KV in the connector's host pool; per layer a device buffer of ``max_running *
    window`` device-window rows (the newest tokens, served in place as resident hits) followed by
    ``max_running * hot_size`` hot rows. Drives the connector in both roles."""

    mode = "hisparse"
    peak_spilled = 0
    mid_request_spills = 0

    def __init__(
        self, cfg: EngineConfig, device: torch.device, binding_fault: Optional[str], on_stats=None
    ) -> None:
        self.cfg = cfg
        self.window = max(1, cfg.recent_window)
        S = cfg.num_state_rows
        self.names = cfg.layer_names()
        self.hot_base = S * self.window
        self.raw, self.flat = packed_rows(
            cfg, S * self.window + S * cfg.hot_size, 1, device, binding_fault
        )
        self.sched, self.worker = open_connector(cfg, S, self.flat, self.hot_base)
        self.host_pool_bytes = int(self.worker.worker.host_rows) * cfg.row_bytes * cfg.num_layers
        self.device_kv_bytes = self.raw.numel()
        self.on_stats = on_stats
        self.closed = False

    def begin_step(self, dec: Sequence, new: Sequence, finished: Sequence[str]) -> None:
        from hisparse.connector import StepSchedule

        sched = {r.rid: 1 for r in dec}
        for r in new:
            sched[r.rid] = r.prompt_len
        out = StepSchedule(num_scheduled_tokens=sched, finished_req_ids=set(finished))
        meta = self.sched.build_connector_meta(out)
        # The connector's state row of a request is its slot: one allocator, and the engine's
        # device window and keys line up with the connector's hot buffers row for row.
        for r, row in zip(new, meta.state_rows[len(dec) :]):
            r.slot = row
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)

    def store(self, layer: int, new: StepRows) -> None:
        if new.window_rows.numel():
            self.flat[layer].index_copy_(
                0, new.window_rows, new.rows.index_select(0, new.window_src)
            )
        self.worker.save_kv_layer(self.names[layer], new.rows, _AttnMeta(new.keys_cpu))

    def read(
        self,
        layer: int,
        sel_keys: torch.Tensor,
        sel_pos: torch.Tensor,
        cur_pos: torch.Tensor,
        slots: torch.Tensor,
        num_prefill: int,
    ) -> torch.Tensor:
        name = self.names[layer]
        B, K = sel_keys.shape
        if self.cfg.is_leader(layer):
            # The group's followers resolve with the leader's selection (the connector hands
            # them the leader's result).
            win = self.window
            in_win = (sel_pos >= 0) & (sel_pos > (cur_pos - win).unsqueeze(1))
            win_row = slots.unsqueeze(1) * win + sel_pos.remainder(win)
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

    def finish(self, req) -> None:
        self.sched.request_finished(ConnectorRequest(req.rid), [])  # frees its state row too

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
