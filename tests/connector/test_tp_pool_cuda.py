"""Two connector workers of one TP group on one GPU (two processes, a gloo group) share one
pinned host pool: rank 0 writes, rank 1 never does, and every row rank 1 gathers is the one rank
0 wrote, at every step, though rank 0 writes late (``tp_ranks_cuda``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.devices import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]
ROOT = Path(__file__).resolve().parents[2]


def test_two_ranks_share_one_pinned_pool_and_gather_rank_0s_rows(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.connector.tp_ranks_cuda", str(r), str(tmp_path)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "pool: SharedHostPool pinned=True" in out and "done" in out
    got0, got1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert torch.equal(got0, got1)
    for i, step in enumerate(range(1, got0.shape[0] + 1)):
        keys = [4 * step - 1, 4 * step - 2, max(0, 4 * step - 7), max(0, 4 * step - 13)]
        for layer in (0, 1):
            want = torch.tensor([10 * (k // 4 + 1) + layer for k in keys], dtype=torch.uint8)
            assert torch.equal(got1[i, layer, :, 0], want), (step, layer)
            assert bool((got1[i, layer] == got1[i, layer, :, :1]).all())
