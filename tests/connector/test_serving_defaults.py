"""What a served model meets at default settings, without vLLM: the counter snapshot's timer,
the new settings' checks, and the log line of a preempted request's state row being reissued."""

from __future__ import annotations

import logging

import pytest

from hisparse.connector import StepSchedule
from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.vllm.connector import HiSparseConnector
from hisparse.vllm.settings import config_from_extra
from tests.helpers import connector_impl, vllm_connector
from tests.telemetry_helpers import Workload, make_pair


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _timed_pair(seconds):
    sched, work, caches = make_pair({"metrics_interval": 1_000_000, "metrics_seconds": seconds})
    clock = FakeClock()
    work.worker.sampler.clock = clock
    work.worker.sampler._last_arm = clock.now
    return sched, work, caches, clock


def test_a_snapshot_is_armed_once_the_set_time_has_passed():
    sched, work, caches, clock = _timed_pair(5.0)
    w = work.worker
    wl = Workload(sched, work, caches, seed=3)
    for _ in range(6):  # 6 steps, far from the step interval, within the time: no snapshot
        assert wl.step() is None
    assert not w.sampler.pending
    clock.now += 5.0
    assert wl.step() is None and w.sampler.pending  # armed on the timer, harvested next call
    got = wl.step()
    assert got is not None
    # The snapshot covers every lookup up to the arming step (the 7th); the 8th is still counted
    # on the device, so the total with a drain equals the independent count.
    rest = w.drain_stats()
    hits = got.data["hits"][0] + (rest.data["hits"][0] if rest else 0)
    misses = got.data["misses"][0] + (rest.data["misses"][0] if rest else 0)
    assert (hits, misses) == (wl.truth.hits, wl.truth.misses) and hits + misses > 0
    clock.now += 4.9
    wl.step()
    assert not w.sampler.pending  # the timer restarts at each arming


def test_the_empty_step_after_the_last_request_reports_every_count():
    """vLLM runs one step with nothing scheduled after the last request finishes: the counts of
    the steps since the last snapshot are reported there, not with the next request."""
    sched, work, caches, clock = _timed_pair(5.0)
    wl = Workload(sched, work, caches, seed=8)
    for _ in range(5):
        assert wl.step() is None
    assert wl.truth.hits + wl.truth.misses > 0
    work.bind_connector_metadata(sched.build_connector_meta(StepSchedule({})))
    work.start_load_kv(None)
    got = work.get_kv_connector_stats()
    work.clear_connector_metadata()
    assert (got.data["hits"][0], got.data["misses"][0]) == (wl.truth.hits, wl.truth.misses)
    assert work.get_kv_connector_stats() is None  # nothing left over


def test_the_timer_can_be_switched_off():
    sched, work, caches, clock = _timed_pair(0)
    wl = Workload(sched, work, caches, seed=3)
    clock.now += 10_000
    for _ in range(4):
        assert wl.step() is None
    assert not work.worker.sampler.pending


def test_defaults_put_counters_within_one_scrape():
    cfg = HiSparseConfig()
    assert 0 < cfg.metrics_seconds <= 10
    assert 0 < cfg.host_pool_fraction < 1


@pytest.mark.parametrize(
    "key, value",
    [
        ("metrics_seconds", -1),
        ("metrics_seconds", True),
        ("metrics_seconds", "5"),
        ("metrics_seconds", float("nan")),
        ("host_pool_fraction", 0),
        ("host_pool_fraction", 1.5),
        ("host_pool_fraction", float("nan")),
        ("host_pool_fraction", None),
    ],
)
def test_new_settings_are_checked_by_name(key, value):
    with pytest.raises(HiSparseConfigError, match=rf"\['{key}'\]"):
        config_from_extra({key: value})


class _Req:
    def __init__(self, rid):
        self.request_id = rid


def test_a_preempted_request_gets_a_fresh_state_row_and_it_is_logged(caplog):
    sched = connector_impl({"top_k": 2, "max_num_seqs": 3}, "scheduler")
    first = sched.build_connector_meta(StepSchedule({"a": 4, "b": 4}))
    row_a = first.state_rows[0]
    # vLLM preempts a: its row is released (reset next step) while b runs on.
    step = StepSchedule({"b": 1}, preempted_req_ids={"a"})
    meta = sched.build_connector_meta(step)
    assert row_a in meta.reset_rows and sched._scheduler.rows.row_of("a") is None
    with caplog.at_level(logging.INFO, logger="vllm.hisparse"):
        meta = sched.build_connector_meta(StepSchedule({"c": 3, "b": 1}))
        meta = sched.build_connector_meta(StepSchedule({"b": 1, "c": 1, "a": 5}))
    assert meta.req_ids[2] == "a" and meta.state_rows[2] in meta.reset_rows
    lines = [r.getMessage() for r in caplog.records if "resumed after preemption" in r.message]
    assert lines == [
        f"HiSparse: request a resumed after preemption: state row {row_a} was released, "
        f"row {meta.state_rows[2]} issued"
    ]
    assert sched._preemptions.resumed == 1 and not sched._preemptions.released


def test_a_request_finished_while_preempted_is_forgotten():
    sched = connector_impl({"top_k": 2, "max_num_seqs": 2}, "scheduler")
    sched.build_connector_meta(StepSchedule({"a": 4}))
    sched.build_connector_meta(StepSchedule({"b": 1}, preempted_req_ids={"a"}))
    assert "a" in sched._preemptions.released
    sched.request_finished(_Req("a"), [])
    assert not sched._preemptions.released


def test_sleep_mode_is_refused_with_one_line():
    assert HiSparseConnector.supports_sleep_mode(None) is False
    work = vllm_connector({"top_k": 2}, "worker")
    for hook in (work.unregister_kv_caches, work.restore_kv_caches):
        with pytest.raises(RuntimeError, match="drop --enable-sleep-mode") as e:
            hook()
        assert "\n" not in str(e.value)
