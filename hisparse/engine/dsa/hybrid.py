"""Hybrid residency in the DSA engine: requests keep their latent rows in device pages while a
budget of ``device_blocks`` blocks allows; beyond it whole requests are spilled to the
connector's host pool and continue through hot buffers; spilled requests come back into pages
when enough are free (policy: ``hisparse.engine.dsa.residency``).

One registered row buffer per layer: ``device_blocks * BLOCK`` page rows, then the connector's
hot buffers (``max_requests * hot_size`` rows, one hot buffer per connector state row). A step
decodes resident and spilled requests together: attention reads each decode's selected rows out
of that one buffer, page rows through the page table (resident) or the hot rows the connector
resolved (spilled), so one ``attend`` call serves the mixed batch. The connector sees only
spilled requests (its batch is their decodes, in batch order). Keys are the engine's:
``slot * max_context + position`` for the index keys and the host pool alike.

A spill writes the request's rows, every layer, to the host pool with the connector's
``save_kv_layer``; a return reads them back with ``load_host_rows``. A spilled request's new
rows are saved every step like HiSparse mode's, a resident request's go to its pages. Decodes
resolve with the gather (``defer_misses`` is not taken: the miss plan addresses the hot rows
only) and the steps run eagerly (no CUDA graphs: the batch's split changes from step to step).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from hisparse.engine.dsa.residency import Residency
from hisparse.engine.dsa.stores import BLOCK, HiSparseRows, injected_fault, layer_buffers
from hisparse.models.dsa.config import DSAConfig


def check_device_blocks(device_blocks, mode: str) -> None:
    """One-line errors for the budget: an integer >= 1, for mode 'hybrid' only."""
    if mode != "hybrid":
        if device_blocks is not None:
            raise ValueError(f"device_blocks applies to mode 'hybrid' only, not {mode!r}")
        return
    if isinstance(device_blocks, bool) or not isinstance(device_blocks, int) or device_blocks < 1:
        raise ValueError(
            f"device_blocks must be an integer >= 1 (device pages of {BLOCK} rows) for mode "
            f"'hybrid', got {device_blocks!r}"
        )


class _Request:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class HybridRows(HiSparseRows):
    """Device pages for resident requests, the connector for spilled ones; the store interface
    of ``ResidentRows`` / ``HiSparseRows`` (``begin``, ``save``, ``decode_rows``,
    ``prefill_rows``, ``end``, ``finish``, ``close``)."""

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
    ) -> None:
        check_device_blocks(device_blocks, "hybrid")
        self.page_rows = device_blocks * BLOCK
        super().__init__(cfg, row_bytes, max_context, device, hot_size, max_requests)
        self.buffers = [self.worker.hot_rows(n) for n in self.names]
        self.res = Residency(device_blocks, BLOCK)
        self.free_slots = list(range(max_requests))
        self.slot: Dict[str, int] = {}  # request id -> engine slot (its block of keys)
        self.held: Dict[int, int] = {}  # slot -> positions written so far
        self.conn_id: Dict[int, str] = {}  # spilled slot -> the connector's request id
        self.fresh: set = set()  # spilled slots the connector has not seen since the spill
        self.spill_gen: Dict[str, int] = {}
        self.pt = torch.zeros(max_requests, -(-max_context // BLOCK), dtype=torch.int64)
        self.pt_dev = self.pt.to(device)
        names = ("spills", "spilled_requests", "spilled_rows", "returns", "returned_rows")
        self.counts = dict.fromkeys(names + ("peak_spilled",), 0)
        self._conn_step = False
        self._plan: Optional[dict] = None
        self.spill_fault = injected_fault("spill")  # a negative control's, never on otherwise

    def _kv_buffers(self, max_requests: int, hot_size: int, row_bytes: int) -> dict:
        rows = self.page_rows + max_requests * hot_size
        return dict(zip(self.names, layer_buffers(len(self.names), rows, row_bytes, self.device)))

    # ---- each step, before the forward -------------------------------------------------
    def begin(self, scheduled: dict) -> List[int]:
        """A step of ``scheduled`` {request id: new tokens}, decodes (known requests) first:
        spills, returns and admissions, the connector's step (spilled requests only), the routes
        of the new rows. Returns each request's slot (its block of keys)."""
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
        """Where this step's new rows go (device pages or the host pool), which decodes read
        pages and which the hot buffers; one upload."""
        dev_src, dev_dst, host_keys, res_dec, sp_dec, sp_pre = [], [], [], [], [], []
        t = 0
        for b, rid in enumerate(rids):
            s, n = self.slot[rid], scheduled[rid]
            lo = self.held[s]
            resident = self.res.resident(s)
            for p in range(lo, lo + n):
                if resident:
                    dev_src.append(t)
                    dev_dst.append(self.res.row(s, p))
                host_keys.append(-1 if resident else s * self.max_context + p)
                t += 1
            if resident:  # the page table's row of it, read by the decodes' row ids
                self.pt[s, : len(self.res.pages[s])] = torch.tensor(self.res.pages[s])
            if lo:  # a decode
                (res_dec if resident else sp_dec).append(b)
            elif not resident:
                sp_pre.append(b)
            self.held[s] = lo + n
        if sp_pre and len(sp_pre) != len(rids) - len(res_dec) - len(sp_dec):
            raise ValueError("hybrid residency: a step's prefills must all be spilled or resident")
        lists = [dev_src, dev_dst, host_keys, sp_dec]
        parts = self._upload(lists + [self.pt.view(-1).tolist()])
        self.pt_dev = parts[-1].view(self.pt.shape)
        self._plan = dict(zip(("dev_src", "dev_dst", "host_keys", "sp_dec"), parts))
        self._plan.update(n_dev=len(dev_src), n_host=t - len(dev_src), n_sp=len(sp_dec))
        self._plan["prefill_host"] = bool(sp_pre)

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

    def _upload(self, lists: List[List[int]]) -> List[torch.Tensor]:
        """Int lists -> device int64 tensors in one copy (pinned, non-blocking on CUDA)."""
        flat = torch.tensor([v for values in lists for v in values], dtype=torch.int64)
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        return list(flat.split([len(values) for values in lists]))

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
        src, keys = self._upload([rows, self._keys(s, m)])
        for layer in range(self.cfg.num_layers):
            self._write_spill(layer, self.buffers[layer].index_select(0, src), keys)
        self.counts["spills"] += 1
        rid = next(r for r, v in self.slot.items() if v == s)
        self._to_host(s, rid, n)

    def _write_spill(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        self.worker.save_kv_layer(self.names[layer], rows, None, slot_mapping=keys)

    def _return(self, s: int) -> None:
        """A spilled request's rows [0, held) back into its new pages; the connector forgets
        it."""
        n = self.held[s]
        rows = [self.res.row(s, p) for p in range(n)]
        dst, keys = self._upload([rows, self._keys(s, n)])
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
        self.sched.request_finished(_Request(crid), [])
        self.finished.add(crid)

    # ---- the forward's calls -----------------------------------------------------------
    def save(self, layer: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        pl = self._plan
        if pl["n_dev"]:
            picked = rows if pl["n_host"] == 0 else rows.index_select(0, pl["dev_src"])
            self.buffers[layer].index_copy_(0, pl["dev_dst"], picked)
        if pl["n_host"]:
            self.worker.save_kv_layer(self.names[layer], rows, None, slot_mapping=pl["host_keys"])

    def _page_ids(self, keys: torch.Tensor) -> torch.Tensor:
        """Device rows of keys (``slot * max_context + position``) through the page table; -1
        stays -1. Keys of spilled requests map to stale rows: the caller replaces them."""
        k = keys.clamp(min=0)
        slot = torch.div(k, self.max_context, rounding_mode="floor")
        pos = k.remainder(self.max_context)
        page = self.pt_dev[slot, torch.div(pos, BLOCK, rounding_mode="floor")]
        return torch.where(keys >= 0, page * BLOCK + pos.remainder(BLOCK), keys)

    def decode_rows(self, layer: int, keys: torch.Tensor, defer_misses: bool = False, decodes=None):
        """(the layer's row buffer, each decode's rows in it, None): page rows of resident
        decodes, hot rows the connector resolved for spilled ones."""
        if decodes is not None and decodes.q > 1:
            raise ValueError("hybrid residency decodes one token per request (no MTP verify)")
        pl, name = self._plan, self.names[layer]
        ids = self._page_ids(keys)
        if pl["n_sp"]:
            sp = pl["sp_dec"]
            top_k = keys.index_select(0, sp).to(torch.int32) if self.cfg.is_full(layer) else None
            got = self.worker.resolve(name, top_k)
            self.worker.wait_for_layer_load(name)
            ids = ids.index_copy(0, sp, got.to(ids.dtype))
        return self.buffers[layer], ids, None

    def prefill_rows(self, layer: int, keys: torch.Tensor):
        """A resident prefill reads its pages, a spilled one the host pool."""
        if self._plan["prefill_host"]:
            return super().prefill_rows(layer, keys)
        return self.buffers[layer], self._page_ids(keys)

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
        self.held.pop(s)
        self.free_slots.append(s)
        self.free_slots.sort()

    def close(self) -> dict:
        """The connector's totals and the residency counters (``spills``: requests spilled
        while running; ``spilled_requests`` adds those admitted spilled; rows per layer)."""
        if self.closed:
            return {}
        return {**super().close(), **self.counts}
