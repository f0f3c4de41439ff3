"""Hybrid residency (docs/engine.md): device pages while they last, the connector's host pool
and hot buffers for requests that spill (the pool reached through ``HostRows``)."""

from __future__ import annotations

from collections import deque
from typing import Dict, List, Optional, Sequence

import torch

from hisparse.connector.host_rows import HostRows
from hisparse.engine.config import EngineConfig
from hisparse.engine.hostkv import open_connector
from hisparse.engine.hybrid_moves import ResidencyMoves, _Staged
from hisparse.engine.hybrid_plan import StepPlan, build_plan, connector_query, page_rows
from hisparse.engine.kvstore import SPILL_FAULTS, StateRows, StepRows, packed_rows


class HybridKV(ResidencyMoves):
    """A request's rows live in device KV pages while they fit; under pressure whole requests
    spill to the connector's host pool and continue from hot buffers; when pages free up,
    spilled requests come back.

    Device allocation, per layer: ``device_pages * block_size`` page rows, then ``hot_slots *
    window`` device-window rows (a spilled request's newest tokens, served in place as the op's
    resident tier), then ``hot_slots * hot_size`` hot rows (registered with the connector, which
    only ever sees spilled requests). Resident requests never touch the connector or the pool.

    Policy, decided on the host from lengths only, so it is the same on every device:
      1. growth: a resident decode request entering a new page takes a free page; with none
         free, the resident request admitted last (latest arrival) is spilled, repeatedly;
      2. returns: spilled requests come back in the order they spilled while their pages fit and
         at least one free page per resident request remains (growth headroom, against ping-pong);
      3. admissions: a new request is resident when its prompt's pages fit with that headroom
         (or when no hot slot is free), else it is admitted spilled.

    Host writes of spilled requests: a spill or a spilled prefill copies whole contiguous key
    ranges (one copy per layer); a spilled request's decode rows go, all layers at once, through
    a pinned staging buffer that the host scatters into the pool ``lag`` (= ``window``) steps
    later (the row is in the device window until then: it leaves the window at that step's
    resolve, which is issued after the scatter).
    """

    mode = "hybrid"

    def __init__(
        self,
        cfg: EngineConfig,
        device: torch.device,
        binding_fault: Optional[str],
        on_stats=None,
        spill_fault: Optional[str] = None,
    ) -> None:
        if spill_fault not in SPILL_FAULTS:
            raise ValueError(f"spill_fault must be one of {SPILL_FAULTS}, got {spill_fault!r}")
        self.spill_fault = spill_fault
        self.cfg = cfg
        self.device = device
        self.on_cuda = device.type == "cuda"
        self.window = max(1, cfg.recent_window)
        self.lag = self.window
        self.num_pages = cfg.num_device_pages
        self.hot_slots = cfg.num_hot_slots
        self.names = cfg.layer_names()
        self.win_base = self.num_pages * cfg.block_size
        rows = self.win_base + self.hot_slots * (self.window + cfg.hot_size)
        self.raw, self.flat = packed_rows(cfg, rows, 1, device, binding_fault)
        self.device_kv_bytes = self.raw.numel()
        self.on_stats = on_stats
        self.sched = self.worker = None
        self.host: Optional[HostRows] = None
        self.host_pool_bytes = 0
        if self.hot_slots:
            self.sched, self.worker = open_connector(
                cfg, self.hot_slots, self.flat, self.win_base + self.hot_slots * self.window
            )
            w = self.worker.worker
            self.host = HostRows(w, self.names)
            self.host_pool_bytes = self.host.pool_bytes
        self._init_residency()

    def _init_residency(self) -> None:
        cfg = self.cfg
        # engine slots; the connector's own rows are hot slots (it only sees spilled requests)
        self.rows = StateRows(cfg.num_state_rows)
        self.free_pages: List[int] = list(range(self.num_pages - 1, -1, -1))  # pop() = lowest
        self.pages: Dict[int, List[int]] = {}  # engine slot -> device pages (resident)
        self.hot: Dict[int, int] = {}  # engine slot -> hot slot (spilled)
        self.free_hot: List[int] = list(range(self.hot_slots - 1, -1, -1))
        self.admitted: Dict[int, int] = {}  # engine slot -> admission order
        self.spill_order: List[int] = []  # spilled slots, oldest spill first
        self.rid: Dict[int, str] = {}
        self.fresh: set = set()  # spilled slots not yet seen by the connector
        self.conn_finished: List[str] = []
        self.pt = torch.zeros(
            cfg.num_state_rows, cfg.pages_per_request, dtype=torch.int64, device=self.device
        )  # page table: slot -> its pages
        self._staged: deque = deque()
        self._step = 0
        self._seq = 0
        self._plan: Optional[StepPlan] = None
        self._conn_step = False
        self._pos: Dict[int, int] = {}
        self._pt_updates: List[tuple] = []
        names = ("spilled_requests", "spilled_rows", "spilled_bytes", "returned_requests")
        self.counts = dict.fromkeys(names + ("returned_rows",), 0)
        self._reported = dict(self.counts)
        self.peak_spilled = 0
        self.mid_request_spills = 0  # spills of running requests (admissions to host excluded)
        self.closed = False

    # ---- policy, each step before the forward ------------------------------------------------
    def begin_step(self, dec: Sequence, new: Sequence, finished: Sequence[str]) -> None:
        for r in new:
            r.slot = self.rows.take()
        self._step += 1
        self._pt_updates = []
        self._pos = {r.slot: r.pos for r in dec}
        # An admission may reuse a finished request's keys: its staged rows must land before
        # anything of the newcomer is written to the pool.
        self._flush(force=bool(new))
        spilled_now = self._grow(dec)
        self._bring_back(spilled_now)
        for r in new:
            self._admit(r)
        self.peak_spilled = max(self.peak_spilled, len(self.hot))
        self._plan = build_plan(self, dec, new, self._pt_updates)
        # The connector sees only spilled decode requests (the fast path: none, no connector).
        self._conn_step = bool(self._plan.num_spilled)
        if self._conn_step:
            self._schedule_connector([r for r in dec if r.slot in self.hot])

    def _grow(self, dec: Sequence) -> set:
        """Rule 1; returns the slots spilled for it (they do not come back in this step)."""
        bs = self.cfg.block_size
        spilled_now = set()
        for r in dec:
            s = r.slot
            pages = self.pages.get(s)
            if pages is None or r.pos // bs < len(pages):
                continue
            while not self.free_pages:
                v = max(self.pages, key=lambda x: self.admitted[x])
                self._spill(v, self._pos[v])
                spilled_now.add(v)
                if v == s:
                    break
            if s in self.pages:
                pages.append(self.free_pages.pop())
                self._set_pages(s, pages, len(pages) - 1)
        return spilled_now

    def _bring_back(self, spilled_now: set) -> None:
        """Rule 2, oldest spill first."""
        for s in list(self.spill_order):
            if s not in self._pos or s in spilled_now:
                continue
            n = self._pos[s]
            if len(self.free_pages) - self._need(n + 1) < len(self.pages) + 1:
                break
            self._return(s, n)

    def _admit(self, r) -> None:
        """Rule 3."""
        s = r.slot
        self.rid[s] = r.rid
        self._seq += 1
        self.admitted[s] = self._seq
        need = self._need(r.prompt_len)
        room = len(self.free_pages) - need
        if room >= 0 and (room >= len(self.pages) + 1 or not self.free_hot):
            pages = [self.free_pages.pop() for _ in range(need)]
            self.pages[s] = pages
            self._set_pages(s, pages, 0)
            return
        if not self.free_hot:
            raise RuntimeError(
                "hybrid residency: no device pages and no hot slot for a new request "
                f"(hot_slots={self.hot_slots}, device_pages={self.num_pages})"
            )
        self.hot[s] = self.free_hot.pop()
        self.spill_order.append(s)
        self.fresh.add(s)
        self._count_spill(r.prompt_len)

    def _schedule_connector(self, spilled: Sequence) -> None:
        from hisparse.connector import StepSchedule

        sched = {}
        for r in spilled:
            # first sight after a spill: the whole context now lives in the pool
            sched[r.rid] = r.pos + 1 if r.slot in self.fresh else 1
            self.fresh.discard(r.slot)
        out = StepSchedule(num_scheduled_tokens=sched, finished_req_ids=set(self.conn_finished))
        self.conn_finished = []
        meta = self.sched.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)

    # ---- the forward's calls -------------------------------------------------------------
    def store(self, layer: int, new: StepRows) -> None:
        pl = self._plan
        f = self.flat[layer]
        rows = new.rows
        if pl.dev_src is None:
            f.index_copy_(0, pl.dev_dst, rows)
        else:
            f.index_copy_(0, pl.dev_dst, rows.index_select(0, pl.dev_src))
        if pl.num_staged:
            torch.index_select(rows, 0, pl.stage_src, out=pl.stage[layer])
        if pl.prefill_src is not None:  # one launch, straight into the (strided) host rows
            self.host.save_layer(layer, rows, pl.prefill_src, pl.prefill_keys)

    def read(
        self,
        layer: int,
        sel_keys: torch.Tensor,
        sel_pos: torch.Tensor,
        cur_pos: torch.Tensor,
        slots: torch.Tensor,
        num_prefill: int,
    ) -> torch.Tensor:
        pl = self._plan
        if self.cfg.is_leader(layer):
            self._phys_res = (
                page_rows(pl, self.pt, self.cfg.block_size, sel_pos, slots)
                if pl.num_resident
                else None
            )
            if pl.num_spilled:
                self._top_k, self._resident = connector_query(
                    pl, self.win_base, self.window, sel_keys, sel_pos, cur_pos
                )
        if not pl.num_spilled:
            return self.flat[layer][self._phys_res]
        name = self.names[layer]
        out = self.worker.resolve(name, self._top_k, resident_rows=self._resident)
        self.worker.wait_for_layer_load(name)
        out = out.long().clamp(min=0)
        if pl.all_spilled:
            return self.flat[layer][out]
        phys = torch.empty(sel_keys.shape, dtype=torch.int64, device=sel_keys.device)
        phys.index_copy_(0, pl.resident_idx, self._phys_res)
        phys.index_copy_(0, pl.spilled_idx, out)
        return self.flat[layer][phys]

    # ---- after the forward ---------------------------------------------------------------
    def end_step(self):
        pl = self._plan
        if pl is not None and pl.num_staged:
            buf = pl.stage
            if self.on_cuda:
                host = torch.empty(buf.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(buf, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            else:
                host, ev = buf, None
            self._staged.append(_Staged(self._step, host, pl.stage_keys, ev))
        self._plan = None
        stats = None
        if self._conn_step:
            self.worker.wait_for_save()
            self.worker.clear_connector_metadata()
            stats = self.worker.get_kv_connector_stats()
            self._emit(stats)
        if self._step % self.cfg.metrics_interval == 0:
            self._emit(self._spill_snapshot())
        return stats

    def _emit(self, stats) -> None:
        if stats is not None and self.on_stats is not None:
            self.on_stats(stats)

    def finish(self, req) -> None:
        s = req.slot
        if s in self.pages:
            self.free_pages.extend(self.pages.pop(s))
            self.free_pages.sort(reverse=True)
        elif s in self.hot:
            self._free_hot_slot(s)
        self.admitted.pop(s, None)
        self.rows.give_back(s)

    def close(self):
        if self.closed:
            return None
        self.closed = True
        self._flush(force=True)
        self._emit(self._spill_snapshot())
        if self.worker is None:
            return None
        stats = self.worker.worker.drain_stats()
        if stats is not None and not stats.is_empty():
            self._emit(stats)
        self.worker.shutdown()
        return stats
