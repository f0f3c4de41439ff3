"""Timing two implementations of one kernel against each other at start-up, as a decode step
runs them: replayed from a CUDA graph. Timed eagerly, a call of a few microseconds of GPU work
measures its host launch path instead (our bmm read took 451 us eagerly and 26 us replayed on an
H200), which would pick by launch overhead a captured step never pays."""

from __future__ import annotations

import importlib
import statistics
from typing import Callable, Iterable, Optional

import torch


def first_module(names: Iterable[str], usable: Callable) -> Optional[object]:
    """The first of ``names`` that imports and that ``usable(module)`` accepts, or None. A build
    that fails to import is as good as none: the project's own kernels serve instead."""
    for name in names:
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - any import failure, not just a missing package
            continue
        if usable(module):
            return module
    return None


def replay_us(fn, calls: int = 10, reps: int = 5) -> float:
    """Median microseconds of one ``fn()`` call, over ``reps`` replays of a graph of ``calls``
    calls. ``fn`` runs once eagerly first (compiles, plans, allocates)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # capture warms up on a side stream, as torch asks
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    return statistics.median(times)
