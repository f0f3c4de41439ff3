"""Driving the decode step: the staged selection drift, CUDA-graph capture and replay, the hit
rate from the index groups' counters, and the eager profile that splits HiSparse's added time.

The random-weight model has no natural step-to-step locality, so the indexer's scores are added
to a staged per-request bias (`Drift`): integer-spaced ranks whose top-k is the selected set.
Each step promotes `m` random positions of each request's own context above every rank (distinct
integers, so no two positions ever tie), which pushes the oldest `m` selected positions out: a
sliding selection whose step-to-step overlap sets the hit rate (the rate itself is read from the
resolve op's counters, not assumed).
"""

from __future__ import annotations

import statistics
from typing import Optional

import torch

from hisparse.engine.graph.step import DecodeStep


class Drift:
    """The staged selection bias [max_batch, ctx] fp32, advanced outside the graph."""

    def __init__(self, max_batch: int, ctx: int, top_k: int, miss: float, device, seed=0):
        self.g = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        ranks = torch.rand(max_batch, ctx, generator=self.g, device=device).argsort(dim=1)
        self.bias = ranks.to(torch.float32)
        # A promoted position already selected changes nothing: aim past that.
        self.m = max(1, round(miss * top_k / (1.0 - top_k / ctx)))

    def advance(self) -> None:
        B, ctx = self.bias.shape
        j = torch.randint(ctx, (B, self.m), generator=self.g, device=self.device)
        top = self.bias.max(dim=1, keepdim=True).values
        # Integer-spaced above every rank: no two positions tie, even after the squashed score.
        # The value follows the position, not the draw: a position drawn twice gets the same
        # value from both writes, so which write lands last (not specified for scatter_, and it
        # varied with what else the GPU ran) cannot change the bias. Exact in float32 for
        # 2**23 / ctx steps (256 at 32k).
        new = top + 1.0 + j.to(torch.float32)
        self.bias.scatter_(1, j, new)


class GraphStep:
    """A DecodeStep captured as one CUDA graph (after eager warm-up steps on a side stream)."""

    def __init__(
        self, step: DecodeStep, drift: Drift, warmup: int = 2, keep_graph: bool = False
    ) -> None:
        """``keep_graph``: torch keeps the captured graph (``graph.raw_cuda_graph()``), for a
        caller that instantiates it itself."""
        self.step, self.drift = step, drift
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.advance_eager()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
        with torch.cuda.graph(self.graph):
            step.forward()

    def advance_eager(self) -> None:
        self.drift.advance()
        self.step.stage(self.drift.bias)
        self.step.forward()

    def stage_next(self) -> None:
        self.drift.advance()
        self.step.stage(self.drift.bias)

    def replay(self) -> None:
        self.graph.replay()

    def timed_steps(self, n: int) -> list:
        """Milliseconds of each of n replays (events around the replay only; the staging of the
        next step runs between them, outside the timed region)."""
        ev = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(n)
        ]
        for a, b in ev:
            self.stage_next()
            a.record()
            self.graph.replay()
            b.record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in ev]


def counters(step: DecodeStep) -> tuple:
    """(hits, misses, moved bytes) summed over the step's index groups (syncs)."""
    tot = [0, 0, 0]
    for g in step.groups:
        for k, v in enumerate(g.counters.cpu().tolist()):
            tot[k] += int(v)
    return tuple(tot)


def hit_rate(before: tuple, after: tuple) -> Optional[float]:
    hits, misses = after[0] - before[0], after[1] - before[1]
    return hits / (hits + misses) if hits + misses else None


class Probe:
    """CUDA events at phase boundaries of eager steps (the step calls `mark`)."""

    def __init__(self) -> None:
        self.events: dict = {}

    def mark(self, key: tuple, stream=None) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream if stream is not None else torch.cuda.current_stream())
        self.events[key] = ev

    def phases(self) -> dict:
        """Per (layer, part): resolve, gather (resolve end -> copy end) and wait (the main
        stream's stall at wait_ready), microseconds."""
        out = {}
        for what, layer, part in list(self.events):
            if what != "res0":
                continue
            e = lambda w: self.events[(w, layer, part)]  # noqa: E731
            out[(layer, part)] = dict(
                resolve_us=1e3 * e("res0").elapsed_time(e("res1")),
                gather_us=1e3 * e("res1").elapsed_time(e("copy1")),
                wait_us=1e3 * e("wait0").elapsed_time(e("wait1")),
            )
        return out


def profile_eager(gs: GraphStep, steps: int) -> dict:
    """Median per-layer phase times over `steps` eager steps (not captured)."""
    per = {"resolve_us": [], "gather_us": [], "wait_us": []}
    for _ in range(steps):
        probe = Probe()
        gs.stage_next()
        gs.step.probe = probe
        gs.step.forward()
        gs.step.probe = None
        torch.cuda.synchronize()
        by_layer: dict = {}
        for (layer, _part), ph in probe.phases().items():
            acc = by_layer.setdefault(layer, {k: 0.0 for k in per})
            for k, v in ph.items():
                acc[k] += v  # parts of one layer add up to the layer's figure
        for acc in by_layer.values():
            for k, v in acc.items():
                per[k].append(v)
    return {k: statistics.median(v) if v else 0.0 for k, v in per.items()}
