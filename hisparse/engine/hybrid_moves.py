"""Hybrid residency's bookkeeping and moves: device pages per request, spills to the host pool,
returns to fresh pages, and the staged host writes of spilled requests' decode rows. The policy
that decides when to move is ``HybridKV.begin_step`` (``hisparse/engine/hybrid.py``)."""

from __future__ import annotations

from typing import List, Sequence

import torch

from hisparse.engine.hostkv import ConnectorRequest


def _spill_range(n: int) -> tuple:
    """Positions a spill of a request holding positions [0, n) copies to the host pool: all."""
    return 0, n


def _window_range(n: int, window: int) -> tuple:
    """Positions a spill copies into the request's device window: the newest ``window - 1``
    (the step's own row, position n, is written there by ``store``). Read from the window while
    ``pos > cur - window``, so these are exactly the ones the resolve will ask it for."""
    return max(0, n - window + 1), n


class _Staged:
    """One step's decode rows of spilled requests, on their way to the host pool."""

    __slots__ = ("step", "buf", "keys", "event")

    def __init__(self, step: int, buf: torch.Tensor, keys: torch.Tensor, event) -> None:
        self.step, self.buf, self.keys, self.event = step, buf, keys, event


class ResidencyMoves:
    """The moves of ``HybridKV``, which owns the state they change (set up in its
    ``__init__``): ``pages`` (slot -> device pages) and ``free_pages``, ``hot`` (slot -> hot
    slot) and ``free_hot``, ``spill_order``, ``fresh``, the device rows ``flat``, the pool's
    per-layer views ``host``, the staged writes and the spill counters."""

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
            out.append(t[o : o + len(l)])
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

    def _window_row(self, hot_slot: int, pos: int) -> int:
        return self.win_base + hot_slot * self.window + pos % self.window

    def _count_spill(self, rows: int) -> None:
        L = self.cfg.num_layers
        self.counts["spilled_requests"] += 1
        self.counts["spilled_rows"] += rows * L
        self.counts["spilled_bytes"] += rows * L * self.cfg.row_bytes

    def _spill_snapshot(self):
        """The spill counters' increase since the last snapshot, as a stats object (None if
        nothing moved)."""
        from hisparse.connector.stats import HiSparseKVConnectorStats

        delta = {k: self.counts[k] - self._reported[k] for k in self.counts}
        if not any(delta.values()):
            return None
        self._reported = dict(self.counts)
        st = HiSparseKVConnectorStats()
        st.record_snapshot(0, 0, 0, **delta)
        return st

    def _flush(self, force: bool = False) -> None:
        """Scatter staged decode rows into the host pool: those due (written ``lag`` steps ago)
        or, with ``force``, all of them."""
        while self._staged and (force or self._staged[0].step <= self._step - self.lag):
            e = self._staged.popleft()
            if e.event is not None:
                e.event.synchronize()
            self.host.scatter(e.keys, e.buf)

    # ---- residency moves -----------------------------------------------------------------
    def _spill(self, slot: int, n: int) -> None:
        """Move positions [0, n) of a resident request to the host pool; its newest
        ``window - 1`` rows also go to its device window (the step's own row is written there
        by ``store``)."""
        if not self.free_hot:
            raise RuntimeError(
                "hybrid residency: device pages are exhausted and every hot slot is taken "
                f"(hot_slots={self.hot_slots}, device_pages={self.num_pages}); raise either"
            )
        pages = self.pages.pop(slot)
        h = self.free_hot.pop()
        src_lo, src_hi = _spill_range(n)
        if self.spill_fault == "off_by_one":
            src_hi = max(src_lo, src_hi - 1)
        rows = self._rows_of(pages, src_lo, src_hi)
        wlo, whi = _window_range(n, self.window)
        wrows = [self._window_row(h, p) for p in range(wlo, whi)]
        src, wsrc, wdst = self._upload([rows, self._rows_of(pages, wlo, whi), wrows])
        k0 = self._key0(slot)
        if rows:  # every layer in one launch, straight into the (strided) host rows
            keys = torch.arange(k0 + src_lo, k0 + src_hi, dtype=torch.int32, device=self.device)
            self.host.save(self.flat, src.to(torch.int32), keys)
        if wrows:
            for f in self.flat:
                f.index_copy_(0, wdst, f.index_select(0, wsrc))
        self.free_pages.extend(reversed(pages))
        self.free_pages.sort(reverse=True)
        self.mid_request_spills += 1
        self.hot[slot] = h
        self.spill_order.append(slot)
        self.fresh.add(slot)
        self._count_spill(n)

    def _return(self, slot: int, n: int) -> None:
        """Bring positions [0, n) of a spilled request back into fresh device pages."""
        self._flush(force=True)  # every row of it must be in the pool before it is read back
        pages = [self.free_pages.pop() for _ in range(self._need(n + 1))]
        self.pages[slot] = pages
        rows = self._rows_of(pages, 0, n)
        (dst,) = self._upload([rows])
        if n:  # every layer in one launch: a one-row plan of n misses
            k0 = self._key0(slot)
            keys = torch.arange(k0, k0 + n, dtype=torch.int32, device=self.device)
            self.host.load(self.flat, keys, dst.to(torch.int32))
        self._set_pages(slot, pages, 0)
        self._free_hot_slot(slot)
        L = self.cfg.num_layers
        self.counts["returned_requests"] += 1
        self.counts["returned_rows"] += n * L

    def _free_hot_slot(self, slot: int) -> None:
        """A spilled request leaves the host side: its hot slot is free, the connector forgets
        it."""
        self.free_hot.append(self.hot.pop(slot))
        self.free_hot.sort(reverse=True)
        self.spill_order.remove(slot)
        self.fresh.discard(slot)
        rid = self.rid[slot]
        self.sched.request_finished(ConnectorRequest(rid), [])
        self.conn_finished.append(rid)

    def _set_pages(self, slot: int, pages: Sequence[int], first: int) -> None:
        for i in range(first, len(pages)):
            self._pt_updates.append((slot, i, pages[i]))
