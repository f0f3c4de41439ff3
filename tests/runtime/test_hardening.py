"""Runtime misuse and loss: reset keeps unreported counts, invalidate_keys refuses keys it would
wrap or could never hold."""

from __future__ import annotations

import re

import pytest
import torch

from tests.runtime.test_runtime import make_group, step
from tests.telemetry_helpers import Workload, make_pair


def _totals(stats):
    return (
        stats.totals() if stats is not None else {"hits": 0, "misses": 0, "host_to_device_bytes": 0}
    )


def test_reset_hot_state_keeps_counts_no_snapshot_reported():
    g, rts = make_group(1)
    step(g, rts, [[1, 2, 3, 4]], [0])
    step(g, rts, [[1, 2, 3, 5]], [0])
    before = g.counters.tolist()
    assert before[:2] == [3, 5]
    rts[0].reset_hot_state()
    assert g.counters.tolist() == before
    assert bool((g.slot_keys == -1).all())
    assert g.lru.tolist() == [list(range(g.hot_size))] * g.num_state_rows
    step(g, rts, [[1, 2, 3, 4]], [0])  # everything misses again after the reset
    assert g.counters[:2].tolist() == [3, 9]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prometheus_totals_survive_resets_at_any_point(seed):
    """Resets between, during and right after snapshots: the reported deltas plus the final
    drain add up to exactly what the workload counted."""
    sched, work, caches = make_pair({"metrics_interval": 3})
    w = work.worker
    wl = Workload(sched, work, caches, seed=seed)
    reported = {"hits": 0, "misses": 0, "host_to_device_bytes": 0}
    for i in range(40):
        stats = wl.step()
        for k, v in _totals(stats).items():
            reported[k] += v
        if i % 7 in (2, 3):  # 3 arms a snapshot (interval 3), so both pending and idle resets
            for g in w.groups:
                g.reset_hot_state()
    for k, v in _totals(w.drain_stats()).items():
        reported[k] += v
    assert wl.truth.misses > 0 and wl.truth.hits > 0
    assert reported == {
        "hits": wl.truth.hits,
        "misses": wl.truth.misses,
        "host_to_device_bytes": wl.truth.bytes,
    }


@pytest.mark.parametrize(
    "key, fragment",
    [
        (2**32 + 1, r"keys must lie in \[0, num_keys=64\), got 4294967297 at index 0"),
        (-5, r"got -5"),
        (10**12, r"got 1000000000000"),
        (64, r"got 64"),
    ],
)
def test_invalidate_keys_refuses_keys_outside_the_pool(key, fragment):
    g, rts = make_group(1)
    step(g, rts, [[1, 2, 3, 4]], [0])
    held = g.slot_keys.clone()
    with pytest.raises(ValueError, match=fragment):
        g.invalidate_keys([0], [key])
    # Key 1 (what 2**32 + 1 wraps to in int32) keeps its hot copy.
    assert torch.equal(g.slot_keys, held)


@pytest.mark.parametrize(
    "keys, fragment",
    [
        ([1.5], "keys[0] must be an integer, got float 1.5"),
        ([True], "keys[0] must be an integer, got bool"),
        ([torch.tensor(1.5)], "keys[0] must be an integer, got Tensor of torch.float32"),
        (torch.tensor([1.0]), "keys must hold integers, got torch.float32"),
        ([2**64], "keys[0] must be <= 9223372036854775807, got 18446744073709551616"),
        (5, "keys must be a sequence of integers, got int"),
    ],
)
def test_invalidate_keys_refuses_non_integer_keys(keys, fragment):
    g, _ = make_group(1)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        g.invalidate_keys([0], keys)


def test_invalidate_keys_takes_an_int64_tensor_in_range():
    g, rts = make_group(1)
    step(g, rts, [[1, 2, 3, 4]], [0])
    g.invalidate_keys(torch.tensor([0]), torch.tensor([63, 3], dtype=torch.int64)[1:])
    assert 3 not in g.slot_keys[0].tolist() and 1 in g.slot_keys[0].tolist()
