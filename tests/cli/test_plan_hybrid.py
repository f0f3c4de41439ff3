"""`hisparse plan`'s hybrid-residency accounting against hand-computed cases."""

from __future__ import annotations

import pytest

from hisparse.cli import app as cli
from hisparse.cli.capacity import PlanInputs, compute, hybrid_resident
from tests.plan_helpers import SMALL_PLAN


def test_small_case_by_hand():
    # per request: resident 144_000 B, spilled 18_048 B on a 1_048_576-B GPU; host 128_000 B
    hy = compute(PlanInputs(**SMALL_PLAN))["hybrid"]
    # 10 running: (1_048_576 - 10 * 18_048) // (144_000 - 18_048) = 6 stay resident
    assert (hy["resident"], hy["spilled"]) == (6, 4)
    assert hy["host_pool_bytes"] == 4 * 128_000  # only spilled requests use the pool
    assert hy["h2d_bytes"] == 4 * 2 * 4 * 32  # 2 misses/request/group x 4 layers
    assert hy["h2d_ms"] == pytest.approx(hy["h2d_bytes"] / 1e9 * 1e3)
    assert hy["spills_above"] == 7 and hy["max_concurrency"] == 58
    assert hy["limited_by"].startswith("GPU")


def test_host_limit_is_looser_than_always_host():
    # a 4 MiB pool holds 32 requests: always-host stops at 32; hybrid at 35 (3 of them resident)
    r = compute(PlanInputs(**{**SMALL_PLAN, "host_mem_gib": 4 / 1024}))
    assert r["max_concurrency"]["hisparse"] == 32
    assert r["hybrid"]["max_concurrency"] == 35 and r["hybrid"]["limited_by"].startswith("host")
    assert hybrid_resident(35, 1_048_576, 144_000, 18_048) == 3


def test_deepseek_batch_30_by_hand(capsys):
    r = compute(
        PlanInputs(
            layers=61,
            row_bytes=656,
            top_k=2048,
            index_share=1,
            indexer_key_bytes=132,
            gpu_mem_gib=40,
            host_mem_gib=256,
            context=40960,
            hot_size=4096,
            miss_rate=0.05,
            pcie_gbps=46,
            batch=30,
        )
    )
    hy = r["hybrid"]
    # (42_949_672_960 - 30 * 493_715_456) // (1_968_865_280 - 493_715_456) = 19
    assert (hy["resident"], hy["spilled"]) == (19, 11)
    assert hy["host_pool_bytes"] == 11 * 40960 * 40016
    assert hy["h2d_bytes"] == pytest.approx(11 * 102.4 * 61 * 656)
    assert cli.main(["plan", "--preset", "deepseek-v3.2", "--batch", "30"]) == 0
    out = capsys.readouterr().out
    assert "all resident up to 21 requests" in out and "19 resident + 11 spilled" in out


def test_batch_past_the_gpu_budget():
    hy = compute(PlanInputs(**{**SMALL_PLAN, "batch": 100}))["hybrid"]
    assert hy["resident"] is None and hy["h2d_bytes"] is None
    assert hybrid_resident(1, 10**9, 10, 10) == 1  # nothing to save: everyone stays resident
