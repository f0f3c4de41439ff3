"""Shared pieces of the DSA engine tests: tiny checkpoints, one-thread runs, near-tie-aware token
comparison."""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch

ARCHS = ("deepseek_v32", "glm_moe_dsa")
#: Below this top-1 / top-2 logit gap a greedy step is a near tie: float32 rounding (another
#: summation order, another device) may pick the other token, so comparisons stop there.
NEAR_TIE = 0.05


@contextlib.contextmanager
def one_thread():
    """The engine's ops are tiny: one torch thread is many times faster on a busy machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def first_near_tie(gaps: Sequence[float]) -> int:
    """Index of the first step whose logit gap is below ``NEAR_TIE`` (len(gaps) if none)."""
    return next((i for i, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))


def tie_aware_mismatch(
    want: List[int], got: List[int], gaps: Sequence[float], other_gaps: Optional[Sequence] = None
) -> Optional[str]:
    """None when ``got`` equals ``want`` up to the first near-tie step (of either run), else a
    message naming the step."""
    stop = first_near_tie(gaps)
    if other_gaps is not None:
        stop = min(stop, first_near_tie(other_gaps))
    for i in range(min(stop + 1, len(want), len(got))):
        if want[i] != got[i]:
            return f"step {i}: want token {want[i]}, got {got[i]} (gap {gaps[i]:.4f})"
    return None
