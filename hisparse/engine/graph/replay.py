"""Capturing a ``CoreStep`` as one CUDA graph per mode and timing its replays: the modes
interleave round by round, each round's median per mode, the ratio taken within each round, and
both modes' outputs compared bit for bit on the same staged selection."""

from __future__ import annotations

import statistics

import torch

from hisparse.engine.graph.step import CoreStep


class Captured:
    """``step.forward(mode)`` captured for each of the step's modes (after eager warm-up steps
    on a side stream); ``outs[mode]`` are the graph's static outputs."""

    def __init__(self, step: CoreStep, warmup: int = 2) -> None:
        self.step, self.graphs, self.outs = step, {}, {}
        for mode in step.modes:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    step.stage()
                    step.forward(mode)
            torch.cuda.current_stream().wait_stream(side)
            self.graphs[mode] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graphs[mode]):
                self.outs[mode] = step.forward(mode)

    def catch_up(self, mode: str) -> None:
        """One untimed step: the other modes' steps moved the selection on meanwhile, so this
        mode's first step would find most of it cold (HiSparse: a step of nearly all misses)."""
        self.step.stage()
        self.graphs[mode].replay()

    def timed(self, mode: str, steps: int) -> float:
        """Median milliseconds of ``steps`` replays (the staging between them not timed)."""
        ev = []
        for _ in range(steps):
            self.step.stage()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.graphs[mode].replay()
            b.record()
            ev.append((a, b))
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in ev)

    def identical(self) -> bool:
        """Every mode's tokens and hidden state equal on one staged selection (replays)."""
        for g in self.graphs.values():
            g.replay()
        torch.cuda.synchronize()
        first, *rest = (self.outs[m] for m in self.step.modes)
        return all(torch.equal(first[0], o[0]) and torch.equal(first[1], o[1]) for o in rest)


def hit_counts(step: CoreStep) -> torch.Tensor:
    """(hits, misses) int64 summed over the step's index groups (a device tensor, no sync)."""
    if not step.groups:
        return torch.zeros(2, dtype=torch.int64)
    return sum(g.counters[:2].view(torch.int64).clone() for g in step.groups)


def measure(step: CoreStep, rounds: int, steps: int, cap=None) -> dict:
    """Per mode ms/step (median of the round medians, min-max spread) and tokens/s; the
    same-round HiSparse / resident ratio and bit-identity when both ran; the hit rate of the
    timed steps. ``cap``: what replays the step (default: its CUDA graphs, ``Captured``)."""
    cap = cap if cap is not None else Captured(step)
    counted = torch.zeros_like(hit_counts(step))
    times = {m: [] for m in step.modes}
    identical = True
    for _ in range(rounds):
        for mode in step.modes:
            cap.catch_up(mode)
            before = hit_counts(step)
            times[mode].append(cap.timed(mode, steps))
            counted += hit_counts(step) - before
        if len(step.modes) == 2:
            identical &= cap.identical()
    row: dict = {"batch": step.batch}
    for m in step.modes:
        med = statistics.median(times[m])
        row[f"{m}_ms_per_step"] = round(med, 4)
        row[f"{m}_spread_ms"] = [round(min(times[m]), 4), round(max(times[m]), 4)]
        row[f"{m}_tok_s"] = round(step.batch / med * 1e3, 1)
    if len(step.modes) == 2:
        same_round = zip(times["hisparse"], times["resident"])
        row["ratio"] = round(statistics.median(h / r for h, r in same_round), 4)
        row["bit_identical"] = identical
    if step.groups:
        hits, misses = (int(v) for v in counted.tolist())
        row["hit_rate"] = round(hits / max(1, hits + misses), 4)
    return row
