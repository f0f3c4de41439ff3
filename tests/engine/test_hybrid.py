"""Hybrid residency in the reference engine: rows stay in device pages while they fit, whole
requests spill to the host pool under pressure and come back; outputs stay bit-identical to
all-resident through every move, and a mistake in the spill path shows up as a parity failure."""

from __future__ import annotations

import pytest
import torch

import hisparse.engine.hybrid_moves as hybrid_moves
from hisparse.engine import EngineConfig, compare_runs, run_workload
from hisparse.engine.hostkv import HiSparseKV
from hisparse.engine.hybrid import HybridKV
from tests.devices import needs_cuda

# Outputs longer than prompts so that resident requests grow into new pages mid-request; jittered
# lengths so that some finish early and free pages for spilled ones to come back.
BASE = dict(
    num_layers=2,
    index_share=1,
    top_k=16,
    hot_size=16,
    hidden=32,
    vocab=128,
    indexer_dim=16,
    drift=0.5,
    recent_window=4,
    prompt_len=40,
    output_len=64,
    length_jitter=0.75,
    num_requests=10,
    max_running=4,
    block_size=8,
    metrics_interval=4,
)
PRESSURE_PAGES = 18  # 4 requests need up to 4 * 13 = 52 pages at max context


@pytest.fixture(scope="module")
def cfg():
    return EngineConfig(**BASE)


@pytest.fixture(scope="module")
def resident(cfg):
    torch.set_num_threads(1)
    return run_workload(cfg, mode="resident", record_attention=True)


def hybrid(cfg, pages=PRESSURE_PAGES, **kw):
    return cfg.replace(residency="hybrid", device_pages=pages, **kw)


@pytest.fixture(scope="module")
def spilled(cfg):
    return run_workload(hybrid(cfg), mode="hisparse", record_attention=True)


def test_spills_and_returns_mid_request_stay_bit_identical(resident, spilled):
    par = compare_runs(resident, spilled)
    assert par.ok and par.attention_equal, par.describe()
    s = spilled.stats
    # the workload really moved whole requests both ways, mid-request
    assert s.mid_request_spills >= 1
    assert s.spilled_requests > s.mid_request_spills  # admissions straight to the pool too
    assert s.returned_requests >= 1 and s.returned_rows > 0
    assert s.misses > 0 and s.peak_spilled >= 2
    assert s.residency == "hybrid"


@pytest.mark.parametrize("pages", [14, 24])
def test_other_budgets_stay_bit_identical(cfg, resident, pages):
    hy = run_workload(hybrid(cfg, pages), mode="hisparse", record_attention=True)
    assert compare_runs(resident, hy).ok
    assert hy.stats.spilled_requests > 0


def test_everything_fits_no_spill_no_connector(cfg, resident):
    """Pages for every state row at max context: nothing spills, the connector is never stepped
    (the fast path), and with no hot slots there is no host pool at all."""
    hy = run_workload(hybrid(cfg, 0), mode="hisparse", record_attention=True)
    assert compare_runs(resident, hy).ok
    s = hy.stats
    assert (s.spilled_requests, s.returned_requests, s.hits, s.misses) == (0, 0, 0, 0)
    bare = run_workload(hybrid(cfg, 0, hot_slots=0), mode="hisparse", record_attention=True)
    assert compare_runs(resident, bare).ok
    assert bare.stats.host_pool_bytes == 0
    assert bare.stats.device_kv_bytes < hy.stats.device_kv_bytes


def test_spill_counters_travel_through_the_stats_pipeline(cfg, spilled):
    """Spill counts in RunStats are what came through the connector stats container, and they
    agree with the engine's own accounting: rows are per layer, bytes = rows * row bytes."""
    s = spilled.stats
    assert s.connector["HiSparse spilled requests"] == s.spilled_requests
    assert s.connector["HiSparse returned rows"] == s.returned_rows
    assert s.spilled_bytes == s.spilled_rows * cfg.row_bytes
    assert s.spilled_rows % cfg.num_layers == 0 and s.returned_rows % cfg.num_layers == 0


def test_always_host_switch_keeps_todays_mode(cfg):
    from hisparse.engine.forward import Engine

    dev = torch.device("cpu")
    assert isinstance(Engine(cfg, "hisparse", dev).kv, HiSparseKV)
    assert isinstance(Engine(cfg.replace(residency="hybrid"), "hisparse", dev).kv, HybridKV)
    with pytest.raises(ValueError, match="residency"):
        EngineConfig(residency="sometimes")
    with pytest.raises(ValueError, match="hot_slots"):
        EngineConfig(max_running=4, hot_slots=5)


# ---- planted faults: each must break parity --------------------------------------------------


def _broken(cfg, resident):
    hy = run_workload(hybrid(cfg), mode="hisparse", record_attention=True)
    return compare_runs(resident, hy)


def test_spill_that_copies_one_row_too_few_fails_parity(cfg, resident, monkeypatch):
    monkeypatch.setattr(hybrid_moves, "_spill_range", lambda n: (0, max(0, n - 1)))
    assert not _broken(cfg, resident).ok


def test_spill_that_skips_the_first_row_fails_parity(cfg, resident, monkeypatch):
    monkeypatch.setattr(hybrid_moves, "_spill_range", lambda n: (min(1, n), n))
    assert not _broken(cfg, resident).ok


def test_spill_window_one_row_short_fails_parity(cfg, resident, monkeypatch):
    monkeypatch.setattr(hybrid_moves, "_window_range", lambda n, w: (max(0, n - w + 2), n))
    assert not _broken(cfg, resident).ok


def test_host_writes_one_step_late_fail_parity(cfg, resident, monkeypatch):
    """Staged decode rows reach the pool ``window`` steps after they were written, just before
    the row leaves the device window; one step later is too late."""
    orig = HybridKV.__init__

    def late(self, *a, **k):
        orig(self, *a, **k)
        self.lag = self.window + 1

    monkeypatch.setattr(HybridKV, "__init__", late)
    assert not _broken(cfg, resident).ok


def test_spill_fault_hook_is_detected(cfg, resident):
    hy = run_workload(hybrid(cfg), mode="hisparse", record_attention=True, spill_fault="off_by_one")
    assert not compare_runs(resident, hy).ok
    with pytest.raises(ValueError, match="residency='hybrid'"):
        run_workload(cfg, mode="hisparse", spill_fault="off_by_one")


def test_exhausted_budget_is_an_error_not_a_wrong_answer(cfg):
    with pytest.raises(RuntimeError, match="hot slot"):
        run_workload(hybrid(cfg, 6, hot_slots=1), mode="hisparse")


@pytest.mark.cuda
@needs_cuda
def test_hybrid_on_cuda_is_bit_identical_to_resident_and_to_cpu(cfg, spilled):
    """Spills, staged host writes, returns and hot-buffer gathers on the GPU (pinned pool, copy
    streams): the same tokens and bits as all-resident on the GPU and as the CPU run."""
    res = run_workload(cfg, mode="resident", device="cuda", record_attention=True)
    for c in (hybrid(cfg), hybrid(cfg, 14), hybrid(cfg.replace(recent_window=0), 18)):
        hy = run_workload(c, mode="hisparse", device="cuda", record_attention=True)
        ref = (
            res
            if c.recent_window == cfg.recent_window
            else run_workload(
                c.replace(residency="host"), mode="resident", device="cuda", record_attention=True
            )
        )
        assert compare_runs(ref, hy).ok, compare_runs(ref, hy).describe()
        assert hy.stats.mid_request_spills >= 1 and hy.stats.returned_requests >= 1
    assert res.tokens == spilled.tokens


def test_spill_counters_reach_a_prometheus_scrape(cfg, resident):
    """End to end: the hybrid run's spill deltas, through the engine's metrics hook, show up in
    the exporter's scrape under the exported names."""
    from prometheus_client.parser import text_string_to_metric_families

    from hisparse.connector.exporter import HiSparseMetricsExporter

    exp = HiSparseMetricsExporter()
    hy = run_workload(hybrid(cfg), mode="hisparse", metrics=exp)
    got = {
        s.name: s.value
        for fam in text_string_to_metric_families(exp.render().decode())
        for s in fam.samples
    }
    s = hy.stats
    assert got["vllm:hisparse_spilled_requests_total"] == s.spilled_requests > 0
    assert got["vllm:hisparse_spilled_rows_total"] == s.spilled_rows
    assert got["vllm:hisparse_spilled_bytes_total"] == s.spilled_bytes
    assert got["vllm:hisparse_returned_requests_total"] == s.returned_requests > 0
    assert got["vllm:hisparse_returned_rows_total"] == s.returned_rows
