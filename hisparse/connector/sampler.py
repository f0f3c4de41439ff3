"""Two-phase, event-gated sampling of the index groups' device counters (docs/telemetry.md).

Phase 1 of a call returns the snapshot armed earlier once its event has completed; phase 2 counts
the call and, every ``interval`` calls or once ``seconds`` have passed since the last snapshot was
armed (so a small server's counters reach a scrape within seconds, not thousands of steps), arms
the next one: copy the counters to pinned host memory without blocking, zero them, record an
event. Reading the host clock is not a device sync. Nothing here synchronises the host with the
device, except ``drain`` (end of run, shutdown, tests, a step with nothing scheduled).

The device plumbing it needs (the compute stream, an event, "is a CUDA graph being captured") is
injected as ``DeviceHooks``, so tests can observe the ordering without a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from hisparse.connector.stats import HiSparseKVConnectorStats


class CompletedEvent:
    """The CPU backend's event: work is done when issued, so it is always complete."""

    def record(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


@dataclass(frozen=True)
class DeviceHooks:
    compute_stream: Callable[[], Any]  # the stream compute runs on now (None on the CPU)
    make_event: Callable[[], Any]  # an event with record(stream), query(), synchronize()
    is_capturing: Callable[[], bool]  # a CUDA graph is being captured on this thread

    @classmethod
    def for_device(cls, device: torch.device) -> "DeviceHooks":
        if device.type == "cuda":
            return cls(
                compute_stream=lambda: torch.cuda.current_stream(device),
                make_event=torch.cuda.Event,
                is_capturing=torch.cuda.is_current_stream_capturing,
            )
        return cls(compute_stream=lambda: None, make_event=CompletedEvent, is_capturing=bool)


class CounterSampler:
    """Snapshots of every group's (hits, misses, moved bytes) and hot rows in use, plus the
    host-pool usage ``usage()`` reports when a snapshot is armed."""

    def __init__(
        self,
        groups: Sequence,
        interval: int,
        hooks: DeviceHooks,
        usage: Callable[[], float],
        seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``seconds``: also arm once this long has passed since the last snapshot (0 = only
        every ``interval`` calls); ``clock``: the time source (tests pass a fake one)."""
        self.groups = list(groups)
        self.interval = interval
        self.seconds = seconds
        self.clock = clock
        self._last_arm = clock()
        self.hooks = hooks
        self.usage = usage
        self.calls = 0
        self.pending = False
        self.event = hooks.make_event()
        device = self.groups[0].device
        n = len(self.groups)
        self._gauges_dev = torch.zeros(n, dtype=torch.int64, device=device)
        self._gauges_host = torch.zeros(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._pending_usage: Optional[float] = None

    def step(self) -> Optional[HiSparseKVConnectorStats]:
        """Once per engine step: the completed snapshot (None when nothing happened), then count
        the call and arm the next snapshot on the interval or the timer (never while capturing a
        CUDA graph or while one is pending)."""
        stats = None
        capturing = self.hooks.is_capturing()  # no event query / copy inside a capture
        if self.pending and not capturing and self.event.query():
            stats = self._harvest()
            self.pending = False
            if stats is None:  # nothing counted yet (prefill steps): the timer stays due
                self._last_arm = float("-inf")
        self.calls += 1
        due = self.calls % self.interval == 0 or (
            self.seconds > 0 and self.clock() - self._last_arm >= self.seconds
        )
        if due and not self.pending and not capturing:
            self._arm()
        return stats

    def drain(self) -> Optional[HiSparseKVConnectorStats]:
        """Blocking: the pending snapshot and everything counted since."""
        if self.hooks.is_capturing():
            raise RuntimeError("drain_stats cannot run while a CUDA graph is being captured")
        out = HiSparseKVConnectorStats()
        if self.pending:
            self.event.synchronize()
            out.aggregate(self._harvest())
            self.pending = False
        self._arm()
        self.event.synchronize()
        out.aggregate(self._harvest())
        self.pending = False
        return None if out.is_empty() else out

    def _arm(self) -> None:
        """Copy device counters to pinned host memory without blocking, zero them, record event."""
        streams = [g.copy_stream for g in self.groups if g.copy_stream is not None]
        compute = self.hooks.compute_stream() if streams else None
        for s in streams:  # gathers (which add moved bytes) and host writes finish first
            compute.wait_stream(s)
        for i, g in enumerate(self.groups):
            g.counters_host.copy_(g.counters, non_blocking=True)
            g.counters.zero_()
            self._gauges_dev[i] = (g.slot_keys >= 0).sum()
        self._gauges_host.copy_(self._gauges_dev, non_blocking=True)
        for s in streams:  # later gathers add into the zeroed counters after the copy
            s.wait_stream(compute)
        if compute is not None:
            self.event.record(compute)
        else:
            self.event.record()
        self._pending_usage = self.usage()
        self.pending = True
        self._last_arm = self.clock()

    def _harvest(self) -> Optional[HiSparseKVConnectorStats]:
        hits = misses = moved = hot_rows = 0
        gauges = self._gauges_host.tolist()
        for i, g in enumerate(self.groups):
            h, m, b = (int(x) for x in g.counters_host.tolist())
            hits, misses, moved = hits + h, misses + m, moved + b
            hot_rows += int(gauges[i]) * len(g.members)
        if not (hits or misses or moved):
            return None
        stats = HiSparseKVConnectorStats()
        stats.record_snapshot(
            hits, misses, moved, host_pool_usage=self._pending_usage, hot_rows_in_use=hot_rows
        )
        return stats
