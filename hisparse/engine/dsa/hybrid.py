"""Hybrid residency in the DSA engine: requests keep their latent rows in device pages while a
budget of ``device_blocks`` blocks allows; beyond it whole requests are spilled to the
connector's host pool and continue through hot buffers; spilled requests come back into pages
when enough are free (policy: ``hisparse.engine.dsa.residency``).

One registered row buffer per layer: ``device_blocks * BLOCK`` page rows, then the connector's
hot buffers (``hot_slots * hot_size`` rows, one per state row: at most ``hot_slots`` requests
spilled at once; default one per request). A step decodes both kinds together: attention reads
each decode's rows out of that one buffer, page rows through the page table or the hot rows the
connector resolved, so one ``attend`` serves the mixed batch. The connector sees only spilled
requests, in batch order. Keys are ``slot * max_context + position``, index keys and host pool.

A spill writes the request's rows, every layer, to the host pool with the connector's
``save_kv_layer``; a return reads them back with ``load_host_rows``. A spilled request's new
rows are saved every step like HiSparse mode's, a resident request's go to its pages. Decodes
resolve with the gather (``defer_misses`` is not taken: the miss plan addresses the hot rows
only).

Decode steps replay from CUDA graphs: the page table and a mixed step's plan sit at fixed device
addresses, so a graph recorded for one split (``graph_key``) serves its later steps.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from hisparse.engine.dsa.residency import Residency, check_device_blocks
from hisparse.engine.dsa.routes import PageTable, route
from hisparse.engine.dsa.stores import (
    BLOCK,
    HiSparseRows,
    Request,
    injected_fault,
    layer_buffers,
    nothing,
    upload,
)
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.kernels.pages import page_rows


class HybridRows(HiSparseRows):
    """Device pages for resident requests, the connector for spilled ones (a row store, as
    ``ResidentRows`` / ``HiSparseRows``)."""

    mode = "hybrid"

    def __init__(
        self,
        cfg: DSAConfig,
        row_bytes: int,
        max_context: int,
        device: torch.device,
        hot_size: int,
        max_requests: int,
        device_blocks: int,
        hot_slots: Optional[int] = None,
    ) -> None:
        """``hot_slots``: hot buffers, so requests spilled at once (default ``max_requests``)."""
        check_device_blocks(device_blocks, "hybrid", hot_slots)
        self.num_page_rows = device_blocks * BLOCK
        self.hot_slots = min(hot_slots or max_requests, max_requests)
        super().__init__(
            cfg, row_bytes, max_context, device, hot_size, max_requests, state_rows=self.hot_slots
        )
        self.buffers = [self.worker.hot_rows(n) for n in self.names]
        self.res = Residency(device_blocks, BLOCK, max_spilled=self.hot_slots)
        self.free_slots = list(range(max_requests))
        self.slot: Dict[str, int] = {}  # request id -> engine slot (its block of keys)
        self.held: Dict[int, int] = {}  # slot -> positions written so far
        self.conn_id: Dict[int, str] = {}  # spilled slot -> the connector's request id
        self.fresh: set = set()  # spilled slots the connector has not seen since the spill
        self.spill_gen: Dict[str, int] = {}
        self.table = PageTable(max_requests, max_context, BLOCK, device)
        self.plan_buf = torch.zeros(4 * max_requests, dtype=torch.int64, device=device)
        names = ("spills", "spilled_requests", "spilled_rows", "returns", "returned_rows")
        self.counts = dict.fromkeys(names + ("peak_spilled",), 0)
        self._conn_step = False
        self._plan: Optional[dict] = None
        self._rows: Optional[torch.Tensor] = None  # an all-resident step's device rows
        self.spill_fault = injected_fault("spill")  # a negative control's, never on otherwise

    def _kv_buffers(self, state_rows: int, hot_size: int, row_bytes: int) -> dict:
        rows = self.num_page_rows + state_rows * hot_size
        return dict(zip(self.names, layer_buffers(len(self.names), rows, row_bytes, self.device)))

    # ---- each step, before the forward -------------------------------------------------
    def begin(self, scheduled: dict) -> List[int]:
        """A step of ``scheduled`` {request id: new tokens}, decodes first: spills, returns,
        admissions, the connector's step (spilled requests), routes; each request's slot."""
        rids = list(scheduled)
        new = [r for r in rids if r not in self.slot]
        if rids[: len(rids) - len(new)] != [r for r in rids if r in self.slot]:
            raise ValueError("hybrid residency: a step's decodes must come before its prefills")
        for rid in new:
            self.slot[rid] = self.free_slots.pop(0)
            self.held[self.slot[rid]] = 0
        spilled_now = set()
        for rid in rids[: len(rids) - len(new)]:
            s = self.slot[rid]
            for victim, pages in self.res.grow(s, self.held[s] + scheduled[rid]):
                self._spill(victim, pages)
                spilled_now.add(victim)
        for s in self.res.returns(self.held, spilled_now):
            self._return(s)
        for rid in new:
            s = self.slot[rid]
            if not self.res.admit(s, scheduled[rid]):
                self._to_host(s, rid, scheduled[rid])
        self.counts["peak_spilled"] = max(self.counts["peak_spilled"], len(self.conn_id))
        self._route(rids, scheduled)
        self._start_connector(rids, scheduled)
        return [self.slot[r] for r in rids]

    def _route(self, rids: List[str], scheduled: dict) -> None:
        """The page table's new rows, and unless every request is resident ("device") or every
        one spilled ("host"; rows go by their keys), ``routes.route``'s plan in ``plan_buf``
        where it fits (a decode step: the addresses its graph recorded)."""
        slots = [self.slot[r] for r in rids]
        new = [scheduled[r] for r in rids]
        pages, self._rows = self.res.pages, None
        resident = sum(s in pages for s in slots)
        decodes = sum(bool(self.held[s]) for s in slots)
        where = {len(slots): "device", 0: "host"}.get(resident, "mixed")
        r = None
        if where == "mixed":
            r = route(slots, new, self.held, pages, self.max_context, BLOCK)
        for s, n in zip(slots, new):
            self.held[s] += n
        self.table.update(slots, pages)
        if r is None:
            host = where == "host"
            self._plan = dict(
                where=where, n_sp=decodes * host, prefill_host=host and decodes < len(slots)
            )
            return
        flat = upload(r.dev_src + r.dev_dst + r.host_keys + r.sp_dec, self.device)
        if flat.numel() <= self.plan_buf.numel():
            flat = self.plan_buf[: flat.numel()].copy_(flat)
        n_dev, n, n_sp = len(r.dev_src), len(r.host_keys), len(r.sp_dec)
        parts = flat.split([n_dev, n_dev, n, n_sp])
        self._plan = dict(zip(("dev_src", "dev_dst", "host_keys", "sp_dec"), parts))
        self._plan.update(n_dev=n_dev, n_host=n - n_dev, n_sp=n_sp, prefill_host=r.prefill_host)
        self._plan["where"] = where

    def admits(self, tokens: int) -> bool:
        """A new request of ``tokens`` prompt tokens gets pages or a hot buffer now."""
        return self.res.can_admit(tokens)

    def graph_key(self) -> tuple:
        """A decode step's split: every request resident or every one spilled, or the rows that
        go to pages, to the host pool, and the spilled decodes (every address a graph read)."""
        pl = self._plan
        return (pl["where"],) if pl["where"] != "mixed" else (pl["n_dev"], pl["n_host"], pl["n_sp"])

    def _start_connector(self, rids: List[str], scheduled: dict) -> None:
        """The connector's step: the scheduled spilled requests, in batch order (decodes first,
        so the leading ones are the batch ``resolve`` gets)."""
        from hisparse.connector import StepSchedule

        sched = {}
        for rid in rids:
            s = self.slot[rid]
            if s in self.conn_id:
                fresh = s in self.fresh  # first sight: its whole context is in the pool now
                sched[self.conn_id[s]] = self.held[s] if fresh else scheduled[rid]
                self.fresh.discard(s)
        self._conn_step = bool(sched)
        if not sched:
            return
        step = StepSchedule(num_scheduled_tokens=sched, finished_req_ids=self.finished)
        meta = self.sched.build_connector_meta(step)
        self.finished = set()
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)

    # ---- moves -----------------------------------------------------------------------
    def _keys(self, s: int, n: int) -> List[int]:
        """Keys of positions [0, n) of slot ``s``."""
        return list(range(s * self.max_context, s * self.max_context + n))

    def _to_host(self, s: int, rid: str, rows: int) -> None:
        """Slot ``s`` is spilled (``rows`` positions of it go to the host pool now): a new
        connector request id (a request may spill again after a return), counted."""
        k = self.spill_gen[rid] = self.spill_gen.get(rid, 0) + 1
        self.conn_id[s] = f"{rid}#{k}"
        self.fresh.add(s)
        self.counts["spilled_requests"] += 1
        self.counts["spilled_rows"] += rows * self.cfg.num_layers

    def _spill(self, s: int, pages: List[int]) -> None:
        """A resident request's rows [0, held) of every layer, out of ``pages`` into the host
        pool through the connector's save."""
        n = self.held[s]
        m = n - 1 if self.spill_fault else n  # stores.inject_faults: the last row never leaves
        rows = [pages[p // BLOCK] * BLOCK + p % BLOCK for p in range(m)]
        src, keys = upload(rows + self._keys(s, m), self.device).split(m)
        for layer in range(self.cfg.num_layers):
            self._write_spill(layer, self.buffers[layer].index_select(0, src), keys)
        self.counts["spills"] += 1
        self.table.forget(s)  # its pages are another's now: rewritten when it returns
        rid = next(r for r, v in self.slot.items() if v == s)
        self._to_host(s, rid, n)

    def _write_spill(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        self.worker.save_kv_layer(self.names[layer], rows, None, slot_mapping=keys)

    def _return(self, s: int) -> None:
        """A spilled request's rows [0, held) back into new pages; the connector forgets it."""
        n = self.held[s]
        rows = [self.res.row(s, p) for p in range(n)]
        dst, keys = upload(rows + self._keys(s, n), self.device).split(n)
        for layer in range(self.cfg.num_layers):
            self._read_back(layer, dst, keys)
        self._leave_connector(s)
        self.counts["returns"] += 1
        self.counts["returned_rows"] += n * self.cfg.num_layers

    def _read_back(self, layer: int, dst: torch.Tensor, keys: torch.Tensor) -> None:
        rows = self.worker.load_host_rows(self.names[layer], keys)
        self.buffers[layer].index_copy_(0, dst, rows)

    def _leave_connector(self, s: int) -> None:
        crid = self.conn_id.pop(s)
        if s in self.fresh:  # never scheduled: the connector does not know it
            self.fresh.discard(s)
            return
        self.sched.request_finished(Request(crid), [])
        self.finished.add(crid)

    # ---- the forward's calls -----------------------------------------------------------
    def save(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        pl = self._plan
        if pl["where"] == "device":  # the step's keys, the same for every layer: translated once
            if self._rows is None:
                self._rows = page_rows(keys, self.table.dev, BLOCK)
            self.buffers[layer].index_copy_(0, self._rows, rows)
        elif pl["where"] == "host":
            self.worker.save_kv_layer(self.names[layer], rows, None, slot_mapping=keys)
        elif pl["n_dev"]:
            picked = rows if pl["n_host"] == 0 else rows.index_select(0, pl["dev_src"])
            self.buffers[layer].index_copy_(0, pl["dev_dst"], picked)
        if pl["where"] == "mixed" and pl["n_host"]:
            self.worker.save_kv_layer(self.names[layer], rows, None, slot_mapping=pl["host_keys"])

    def decode_rows(
        self, layer: int, keys: torch.Tensor, defer_misses: bool = False, decodes=None, *,
        beside: Callable[[], None] = nothing,
    ):  # fmt: skip
        """(the layer's row buffer, each decode's rows in it, None): page rows of resident
        decodes, hot rows the connector resolved for spilled ones (``beside``: as HiSparse's)."""
        if decodes is not None and decodes.q > 1:
            raise ValueError("hybrid residency decodes one token per request (no MTP verify)")
        pl, name = self._plan, self.names[layer]
        if not pl["n_sp"]:
            beside()
            return self.buffers[layer], page_rows(keys, self.table.dev, BLOCK), None
        everyone = pl["n_sp"] == keys.shape[0]
        sp = None if everyone else pl["sp_dec"]
        full = self.cfg.is_full(layer)
        top_k = (keys if everyone else keys.index_select(0, sp)).to(torch.int32) if full else None
        got = self.worker.resolve(name, top_k)
        beside()
        self.worker.wait_for_layer_load(name)
        if everyone:
            return self.buffers[layer], got, None
        ids = page_rows(keys, self.table.dev, BLOCK)
        return self.buffers[layer], ids.index_copy(0, sp, got.to(ids.dtype)), None

    def prefill_rows(self, layer: int, keys: torch.Tensor):
        """A resident prefill reads its pages, a spilled one the host pool."""
        if self._plan["prefill_host"]:
            return super().prefill_rows(layer, keys)
        return self.buffers[layer], page_rows(keys, self.table.dev, BLOCK)

    # ---- after the forward -------------------------------------------------------------
    def end(self) -> None:
        self._plan = None
        if self._conn_step:
            super().end()
        self._conn_step = False

    def finish(self, rid: str) -> None:
        s = self.slot.pop(rid)
        if s in self.conn_id:
            self._leave_connector(s)
        self.res.release(s)
        self.table.forget(s)
        self.held.pop(s)
        self.free_slots.append(s)
        self.free_slots.sort()

    def close(self) -> dict:
        """The connector's totals and the residency counters (``spills``: requests spilled
        while running; ``spilled_requests`` adds those admitted spilled; rows per layer)."""
        if self.closed:
            return {}
        return {**super().close(), **self.counts}
