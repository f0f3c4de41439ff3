"""The staged selection of the graph step: which context positions attention reads each step.

Random weights have no natural step-to-step locality, so the rows attention reads follow a
staged per-request bias: integer-spaced ranks whose top-k is the selected set. Each step
promotes ``m`` random positions of each request's own context above every rank (distinct
integers, so no two positions ever tie), which pushes the oldest ``m`` selected positions out: a
sliding selection whose step-to-step overlap sets the hit rate (the rate itself is read from
the resolve op's counters, not assumed).
"""

from __future__ import annotations

import torch


class Drift:
    """The staged selection bias [max_batch, ctx] fp32, advanced outside the graph."""

    def __init__(self, max_batch: int, ctx: int, top_k: int, miss: float, device, seed=0):
        if not 0.0 < miss < 1.0:
            raise ValueError(f"miss must lie in (0, 1), got {miss}")
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
        # The value follows the position, not the draw: a position drawn twice gets the same
        # value from both writes, so which write lands last (not specified for scatter_) cannot
        # change the bias. Exact in float32 for 2**23 / ctx steps (256 at 32k).
        new = top + 1.0 + j.to(torch.float32)
        self.bias.scatter_(1, j, new)
