"""Where the engine's KV rows live: all on the device (resident) or host pool + hot buffers
driven through the HiSparse connector (hisparse).

Both backends expose the same three calls to the forward pass: ``store`` (this step's new rows),
``read`` (the selected rows, as bytes, in selection order) and the step hooks. Attention decodes
whatever bytes ``read`` returns, so the two modes agree bit for bit exactly when the rows are
right.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from hisparse.binding import PackedLayout, bind_layers, layer_view
from hisparse.engine.config import EngineConfig

BINDING_FAULTS = (None, "base_offset")
# Negative control of the hybrid spill path: a spill copies one row too few to the host pool.
SPILL_FAULTS = (None, "off_by_one")


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

    def begin_step(self, dec: Sequence, new: Sequence, finished: Sequence[str]) -> None:
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

    def begin_step(self, dec: Sequence, new: Sequence, finished: Sequence[str]) -> None:
        from hisparse.connector import StepSchedule

        sched = {r.rid: 1 for r in dec}
        for r in new:
            sched[r.rid] = r.prompt_len
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

    def finish(self, req) -> None:
        self.sched.request_finished(_Req(req.rid), [])

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


class _Staged:
    """One step's decode rows of spilled requests, on their way to the host pool."""
    __slots__ = ("step", "buf", "keys", "event")

    def __init__(self, step: int, buf: torch.Tensor, keys: torch.Tensor, event) -> None:
        self.step, self.buf, self.keys, self.event = step, buf, keys, event


class HybridKV:
    """Hybrid residency: a request's rows live in device KV pages while they fit; under pressure
    whole requests spill to the connector's host pool and continue from hot buffers; when pages
    free up, spilled requests come back.

    Device allocation, per layer: ``device_pages * block_size`` page rows, then ``hot_slots * W``
    device-window rows (a spilled request's newest W tokens, served in place as the op's resident
    tier), then ``hot_slots * hot_size`` hot rows (registered with the connector, which only ever
    sees spilled requests). Resident requests never touch the connector or the host pool.

    Policy (docs/engine.md, "Hybrid residency"), decided on the host from lengths only, so it is
    the same on every device:
      1. growth: a resident decode request entering a new page takes a free page; with none
         free, the resident request admitted last (latest arrival) is spilled, repeatedly;
      2. returns: spilled requests come back in the order they spilled while their pages fit and
         at least one free page per resident request remains (growth headroom, against ping-pong);
      3. admissions: a new request is resident when its prompt's pages fit with that headroom
         (or when no hot slot is free), else it is admitted spilled.

    Host writes of spilled requests: a spill or a spilled prefill copies whole contiguous key
    ranges (one copy per layer); a spilled request's decode rows go, all layers at once, through
    a pinned staging buffer that the host scatters into the pool ``W`` steps later (the row is
    in the device window until then: it leaves the window at that step's resolve, which is
    issued after the scatter).
    """

    mode = "hybrid"

    def __init__(self, cfg: EngineConfig, device: torch.device, binding_fault: Optional[str],
                 on_stats=None, spill_fault: Optional[str] = None) -> None:
        if spill_fault not in SPILL_FAULTS:
            raise ValueError(f"spill_fault must be one of {SPILL_FAULTS}, got {spill_fault!r}")
        self.spill_fault = spill_fault
        self.cfg = cfg
        self.device = device
        self.on_cuda = device.type == "cuda"
        S, C, bs = cfg.num_state_rows, cfg.max_context, cfg.block_size
        self.W = self.window = max(1, cfg.recent_window)
        self.lag = self.W
        self.num_pages = cfg.num_device_pages
        self.hot_slots = cfg.num_hot_slots
        names = cfg.layer_names()
        self.names = names
        rb, L = cfg.row_bytes, cfg.num_layers
        self.page_rows = self.num_pages * bs
        self.win_base = self.page_rows
        rows = self.page_rows + self.hot_slots * (self.W + cfg.hot_size)
        self.layout = PackedLayout(names, num_blocks=rows, block_size=1, row_bytes=rb)
        self.raw = torch.zeros(self.layout.nbytes(), dtype=torch.uint8, device=device)
        views = packed_views(self.raw, self.layout, binding_fault)
        self.flat = [_flat(views[n]) for n in names]
        self.device_kv_bytes = self.raw.numel()
        self.on_stats = on_stats
        self.sched = self.worker = None
        self.host = []
        self.host_pool_bytes = 0
        if self.hot_slots:
            from hisparse.connector import HiSparseConnector

            extra = {
                "host_pool_gib": (cfg.num_keys + bs) * rb * L / 2**30,
                "top_k": cfg.top_k,
                "device_buffer_size": cfg.hot_size,
                "index_share": cfg.index_share,
                "metrics_interval": cfg.metrics_interval,
                "max_num_seqs": self.hot_slots,
                "block_size": bs,
            }
            self.sched = HiSparseConnector.from_extra_config(extra, role="scheduler")
            self.worker = HiSparseConnector.from_extra_config(extra, role="worker")
            self.worker.register_kv_caches({n: self.flat[i] for i, n in enumerate(names)})
            w = self.worker.worker
            if w.hot_base != self.win_base + self.hot_slots * self.W:
                raise RuntimeError(f"connector hot_base {w.hot_base} != engine's "
                                   f"{self.win_base + self.hot_slots * self.W}")
            self.host = [w.host_view(n) for n in names]
            self.host_pool_bytes = int(w.host_rows) * rb * L
        # residency state (host side)
        self.free_pages: List[int] = list(range(self.num_pages - 1, -1, -1))  # pop() = lowest
        self.pages: Dict[int, List[int]] = {}      # engine slot -> device pages (resident)
        self.hot: Dict[int, int] = {}              # engine slot -> hot slot (spilled)
        self.free_hot: List[int] = list(range(self.hot_slots - 1, -1, -1))
        self.admitted: Dict[int, int] = {}         # engine slot -> admission order
        self.spill_order: List[int] = []           # spilled slots, oldest spill first
        self.rid: Dict[int, str] = {}
        self.fresh: set = set()                    # spilled slots not yet seen by the connector
        self.conn_finished: List[str] = []
        self.pt = torch.zeros(S, cfg.pages_per_request, dtype=torch.int64, device=device)
        self._staged: deque = deque()
        self._step = 0
        self._seq = 0
        self._plan = None
        self._conn_step = False
        self._pos: Dict[int, int] = {}
        self.counts = dict(spilled_requests=0, spilled_rows=0, spilled_bytes=0,
                           returned_requests=0, returned_rows=0)
        self._reported = dict(self.counts)
        self.peak_spilled = 0
        self.mid_request_spills = 0   # spills of running requests (admissions to host excluded)
        self.closed = False

    # ---- small helpers -------------------------------------------------------------------
    def _upload(self, lists: Sequence[Sequence[int]]) -> List[torch.Tensor]:
        """Several small int lists -> device int64 tensors with one host->device copy (from
        pinned memory on CUDA, so it does not synchronise)."""
        flat = [v for l in lists for v in l]
        t = torch.tensor(flat, dtype=torch.int64)
        if self.on_cuda and flat:
            t = t.pin_memory().to(self.device, non_blocking=True)
        out, o = [], 0
        for l in lists:
            out.append(t[o:o + len(l)])
            o += len(l)
        return out

    def _rows_of(self, pages: Sequence[int], lo: int, hi: int) -> List[int]:
        """Device page rows of positions [lo, hi) of a request holding ``pages``."""
        bs = self.cfg.block_size
        return [pages[p // bs] * bs + p % bs for p in range(lo, hi)]

    def _need(self, n: int) -> int:
        return -(-n // self.cfg.block_size)

    def _key0(self, slot: int) -> int:
        return slot * self.cfg.max_context

    def _flush(self, force: bool = False) -> None:
        """Scatter staged decode rows into the host pool: those due (written ``lag`` steps ago)
        or, with ``force``, all of them."""
        while self._staged and (force or self._staged[0].step <= self._step - self.lag):
            e = self._staged.popleft()
            if e.event is not None:
                e.event.synchronize()
            for l, host in enumerate(self.host):
                host.index_copy_(0, e.keys, e.buf[l])

    # ---- residency moves -----------------------------------------------------------------
    def _spill(self, slot: int, n: int) -> None:
        """Move positions [0, n) of a resident request to the host pool; its newest W-1 rows
        also go to its device window (the step's own row is written there by ``store``)."""
        if not self.free_hot:
            raise RuntimeError(
                "hybrid residency: device pages are exhausted and every hot slot is taken "
                f"(hot_slots={self.hot_slots}, device_pages={self.num_pages}); raise either")
        pages = self.pages.pop(slot)
        h = self.free_hot.pop()
        src_lo, src_hi = _spill_range(n)
        if self.spill_fault == "off_by_one":
            src_hi = max(src_lo, src_hi - 1)
        rows = self._rows_of(pages, src_lo, src_hi)
        wlo, whi = _window_range(n, self.W)
        wrows = [self.win_base + h * self.W + p % self.W for p in range(wlo, whi)]
        src, wsrc, wdst = self._upload([rows, self._rows_of(pages, wlo, whi), wrows])
        k0 = self._key0(slot)
        for l, f in enumerate(self.flat):
            if rows:
                moved = f.index_select(0, src)
                self.host[l][k0 + src_lo:k0 + src_hi].copy_(moved, non_blocking=True)
            if wrows:
                f.index_copy_(0, wdst, f.index_select(0, wsrc))
        self.free_pages.extend(reversed(pages))
        self.free_pages.sort(reverse=True)
        self.mid_request_spills += 1
        self.hot[slot] = h
        self.spill_order.append(slot)
        self.fresh.add(slot)
        L = self.cfg.num_layers
        self.counts["spilled_requests"] += 1
        self.counts["spilled_rows"] += n * L
        self.counts["spilled_bytes"] += n * L * self.cfg.row_bytes

    def _return(self, slot: int, n: int) -> None:
        """Bring positions [0, n) of a spilled request back into fresh device pages."""
        self._flush(force=True)  # every row of it must be in the pool before it is read back
        pages = [self.free_pages.pop() for _ in range(self._need(n + 1))]
        self.pages[slot] = pages
        rows = self._rows_of(pages, 0, n)
        (dst,) = self._upload([rows])
        k0 = self._key0(slot)
        for l, f in enumerate(self.flat):
            src = self.host[l][k0:k0 + n]
            f.index_copy_(0, dst, src.to(self.device, non_blocking=True) if self.on_cuda else src)
        self._set_pages(slot, pages, 0)
        h = self.hot.pop(slot)
        self.free_hot.append(h)
        self.free_hot.sort(reverse=True)
        self.spill_order.remove(slot)
        self.fresh.discard(slot)
        self._release_conn(slot)
        L = self.cfg.num_layers
        self.counts["returned_requests"] += 1
        self.counts["returned_rows"] += n * L

    def _release_conn(self, slot: int) -> None:
        rid = self.rid[slot]
        self.sched.request_finished(_Req(rid), [])
        self.conn_finished.append(rid)

    def _set_pages(self, slot: int, pages: Sequence[int], first: int) -> None:
        for i in range(first, len(pages)):
            self._pt_updates.append((slot, i, pages[i]))

    # ---- engine hooks --------------------------------------------------------------------
    def begin_step(self, dec: Sequence, new: Sequence, finished: Sequence[str]) -> None:
        cfg, bs = self.cfg, self.cfg.block_size
        self._step += 1
        self._pt_updates: List[tuple] = []
        self._pos = {r.slot: r.pos for r in dec}
        spilled_now = set()
        if new:
            # An admission may reuse a finished request's keys: its staged rows must land
            # before anything of the newcomer is written to the pool.
            self._flush(force=True)
        else:
            self._flush()
        # 1. growth of resident decode requests
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
        # 2. returns, oldest spill first
        for s in list(self.spill_order):
            if s not in self._pos or s in spilled_now:
                continue
            n = self._pos[s]
            if len(self.free_pages) - self._need(n + 1) < len(self.pages) + 1:
                break
            self._return(s, n)
        # 3. admissions
        for r in new:
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
            else:
                if not self.free_hot:
                    raise RuntimeError(
                        "hybrid residency: no device pages and no hot slot for a new request "
                        f"(hot_slots={self.hot_slots}, device_pages={self.num_pages})")
                self.hot[s] = self.free_hot.pop()
                self.spill_order.append(s)
                self.fresh.add(s)
                L = self.cfg.num_layers
                self.counts["spilled_requests"] += 1
                self.counts["spilled_rows"] += r.prompt_len * L
                self.counts["spilled_bytes"] += r.prompt_len * L * self.cfg.row_bytes
        self.peak_spilled = max(self.peak_spilled, len(self.hot))
        self._build_plan(dec, new, finished)

    def _build_plan(self, dec: Sequence, new: Sequence, finished: Sequence[str]) -> None:
        cfg, bs, W = self.cfg, self.cfg.block_size, self.W
        dev_dst, dev_src, stage_src, stage_keys = [], [], [], []
        rs_idx, sp_idx, sp_hot = [], [], []
        all_dev = True
        for i, r in enumerate(dec):
            s, p = r.slot, r.pos
            if s in self.pages:
                pg = self.pages[s]
                dev_dst.append(pg[p // bs] * bs + p % bs)
                dev_src.append(i)
                rs_idx.append(i)
            else:
                h = self.hot[s]
                dev_dst.append(self.win_base + h * W + p % W)
                dev_src.append(i)
                stage_src.append(i)
                stage_keys.append(self._key0(s) + p)
                sp_idx.append(i)
                sp_hot.append(h)
        off = len(dec)
        prefill_host = []
        for r in new:
            s, P = r.slot, r.prompt_len
            if s in self.pages:
                dev_dst.extend(self._rows_of(self.pages[s], 0, P))
                dev_src.extend(range(off, off + P))
            else:
                h = self.hot[s]
                lo = max(0, P - W)
                dev_dst.extend(self.win_base + h * W + q % W for q in range(lo, P))
                dev_src.extend(range(off + lo, off + P))
                all_dev = False
                prefill_host.append((self._key0(s), off, P))
            off += P
        pt_s = [u[0] for u in self._pt_updates]
        pt_i = [u[1] for u in self._pt_updates]
        pt_v = [u[2] for u in self._pt_updates]
        (t_dst, t_src, t_stage, t_rs, t_sp, t_hot, t_ps, t_pi, t_pv) = self._upload(
            [dev_dst, dev_src if not all_dev else [], stage_src, rs_idx, sp_idx, sp_hot,
             pt_s, pt_i, pt_v])
        if pt_s:
            self.pt[t_ps, t_pi] = t_pv
        self._plan = dict(
            dev_dst=t_dst, dev_src=None if all_dev else t_src, stage_src=t_stage,
            stage_keys=torch.tensor(stage_keys, dtype=torch.int64), n_stage=len(stage_src),
            rs_idx=t_rs, sp_idx=t_sp, sp_hot=t_hot, n_rs=len(rs_idx), n_sp=len(sp_idx),
            all_sp=len(sp_idx) == len(dec), prefill_host=prefill_host,
            stage=(torch.empty(cfg.num_layers, len(stage_src), cfg.row_bytes, dtype=torch.uint8,
                               device=self.device) if stage_src else None))
        # The connector sees only spilled decode requests (the fast path: none, no connector).
        self._conn_step = bool(sp_idx)
        if self._conn_step:
            from hisparse.connector import StepSchedule

            sched = {}
            for i in sp_idx:
                r = dec[i]
                # first sight after a spill: the whole context now lives in the pool
                sched[r.rid] = r.pos + 1 if r.slot in self.fresh else 1
                self.fresh.discard(r.slot)
            out = StepSchedule(num_scheduled_tokens=sched, finished_req_ids=set(self.conn_finished))
            self.conn_finished = []
            meta = self.sched.build_connector_meta(out)
            self.worker.bind_connector_metadata(meta)
            self.worker.start_load_kv(None)

    def store(self, layer: int, new: StepRows) -> None:
        pl = self._plan
        f = self.flat[layer]
        rows = new.rows
        if pl["dev_src"] is None:
            f.index_copy_(0, pl["dev_dst"], rows)
        else:
            f.index_copy_(0, pl["dev_dst"], rows.index_select(0, pl["dev_src"]))
        if pl["n_stage"]:
            torch.index_select(rows, 0, pl["stage_src"], out=pl["stage"][layer])
        for k0, off, P in pl["prefill_host"]:
            src = rows[off:off + P]
            self.host[layer][k0:k0 + P].copy_(src, non_blocking=True)

    def read(self, layer: int, sel_keys: torch.Tensor, sel_pos: torch.Tensor, cur_pos: torch.Tensor,
             slots: torch.Tensor, num_prefill: int) -> torch.Tensor:
        pl = self._plan
        cfg, bs, W = self.cfg, self.cfg.block_size, self.W
        name = self.names[layer]
        if cfg.is_leader(layer):
            phys = None
            if pl["n_rs"]:
                if pl["n_sp"]:
                    rs = pl["rs_idx"]
                    sp, sl = sel_pos.index_select(0, rs), slots.index_select(0, rs)
                else:
                    sp, sl = sel_pos, slots
                spc = sp.clamp(min=0)
                phys = self.pt[sl.unsqueeze(1), spc // bs] * bs + spc % bs
            if pl["n_sp"]:
                if pl["all_sp"]:
                    keys, sp, cp = sel_keys, sel_pos, cur_pos
                else:
                    idx = pl["sp_idx"]
                    keys, sp, cp = (sel_keys.index_select(0, idx), sel_pos.index_select(0, idx),
                                    cur_pos.index_select(0, idx))
                in_win = (sp >= 0) & (sp > (cp - W).unsqueeze(1))
                win_row = self.win_base + pl["sp_hot"].unsqueeze(1) * W + sp.remainder(W)
                self._top_k = keys.to(torch.int32)
                self._resident = torch.where(in_win, win_row, torch.full_like(win_row, -1)).to(torch.int32)
            self._phys_res = phys
        if not pl["n_sp"]:
            return self.flat[layer][self._phys_res]
        out = self.worker.resolve(name, self._top_k, resident_rows=self._resident)
        self.worker.wait_for_layer_load(name)
        out = out.long().clamp(min=0)
        if pl["all_sp"]:
            return self.flat[layer][out]
        phys = torch.empty(sel_keys.shape, dtype=torch.int64, device=sel_keys.device)
        phys.index_copy_(0, pl["rs_idx"], self._phys_res)
        phys.index_copy_(0, pl["sp_idx"], out)
        return self.flat[layer][phys]

    def end_step(self):
        pl = self._plan
        if pl is not None and pl["n_stage"]:
            buf = pl["stage"]
            if self.on_cuda:
                host = torch.empty(buf.shape, dtype=torch.uint8, pin_memory=True)
                host.copy_(buf, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
            else:
                host, ev = buf, None
            self._staged.append(_Staged(self._step, host, pl["stage_keys"], ev))
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

    def _spill_snapshot(self):
        from hisparse.stats import HiSparseKVConnectorStats

        delta = {k: self.counts[k] - self._reported[k] for k in self.counts}
        if not any(delta.values()):
            return None
        self._reported = dict(self.counts)
        st = HiSparseKVConnectorStats()
        st.record_snapshot(0, 0, 0, **delta)
        return st

    def _emit(self, stats) -> None:
        if stats is not None and self.on_stats is not None:
            self.on_stats(stats)

    def finish(self, req) -> None:
        s = req.slot
        if s in self.pages:
            self.free_pages.extend(self.pages.pop(s))
            self.free_pages.sort(reverse=True)
        elif s in self.hot:
            self.free_hot.append(self.hot.pop(s))
            self.free_hot.sort(reverse=True)
            self.spill_order.remove(s)
            self.fresh.discard(s)
            self._release_conn(s)
        self.admitted.pop(s, None)

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


def _spill_range(n: int) -> tuple:
    """Positions a spill of a request holding positions [0, n) copies to the host pool: all."""
    return 0, n


def _window_range(n: int, window: int) -> tuple:
    """Positions a spill copies into the request's device window: the newest ``window - 1``
    (the step's own row, position n, is written there by ``store``). Read from the window while
    ``pos > cur - window``, so these are exactly the ones the resolve will ask it for."""
    return max(0, n - window + 1), n
