"""Decode-only wall time of a ``generate`` run: what a throughput benchmark divides by.

Every step ends with its greedy tokens read on the host, so a step boundary is already a point
where the host has caught up with the compute stream; the connector's copy streams may still be
busy there, so the clock synchronises the device where a stretch of timed steps starts and
where it ends, and nowhere else (a sync per step would time the syncs too).

A decode-only step is one that decodes and admits no prompt. The first ``skip`` of a run are
not timed: on CUDA a batch size's first decode step runs eagerly (compiling kernels) and its
second captures the step's graph (``graphs.DecodeGraphs``), costs a server pays once at start-up.
Every mode skips alike, so eager and graph runs are timed over the same steps. A batch that
shrinks (requests finishing at different steps) meets new sizes inside the timed stretch; a
benchmark that wants one size gives every request the same length and admits all before any
decodes (``generate(..., prefill_first=True)``).
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

import torch

UNTIMED_DECODES = 2


class DecodeClock:
    """``before(decodes, prefills)`` ahead of every step, ``stop()`` after the last one; then
    ``seconds``, ``steps`` and ``tokens`` of the timed decode-only steps."""

    def __init__(self, device: torch.device, skip: int = UNTIMED_DECODES) -> None:
        self.device, self.skip = device, skip
        self.seen = 0  # decode-only steps so far, timed or not
        self.seconds, self.steps, self.tokens = 0.0, 0, 0
        self._t0: Optional[float] = None

    def before(self, decodes: int, prefills: int) -> None:
        """A step of ``decodes`` one-token decodes and ``prefills`` admitted prompts follows."""
        if prefills or not decodes:
            self.stop()
            return
        self.seen += 1
        if self.seen <= self.skip:
            return
        if self._t0 is None:
            self._sync()
            self._t0 = time.perf_counter()
        self.steps += 1
        self.tokens += decodes

    def stop(self) -> None:
        """Close the stretch of timed steps, if one is open."""
        if self._t0 is not None:
            self._sync()
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None

    def totals(self) -> Tuple[float, int, int]:
        """(seconds, steps, tokens) of the timed steps."""
        return self.seconds, self.steps, self.tokens

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
