"""End to end: workload -> runtimes -> worker snapshots -> (IPC) -> observe -> HTTP scrape."""

from __future__ import annotations

import pickle
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hisparse.connector import HiSparseConnectorImpl
from hisparse.connector.exporter import HiSparseMetricsExporter
from tests.telemetry_helpers import Workload, make_pair


def _scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


@pytest.mark.parametrize("interval", [1, 3, 7])
def test_scraped_counters_equal_true_totals(interval):
    sched, work, caches = make_pair({"metrics_interval": interval})
    wl = Workload(sched, work, caches, seed=interval)
    exporter = HiSparseMetricsExporter(engine_indexes=(0,))
    port = exporter.start(0)
    try:
        observed = 0
        for _ in range(40):
            stats = wl.step()
            if stats is not None:
                # What crosses the worker -> scheduler -> logger boundary is `data`.
                wire = pickle.loads(pickle.dumps(stats.data))
                exporter.observe(HiSparseConnectorImpl.build_kv_connector_stats(wire).data, 0)
                observed += 1
        assert observed >= 2  # several snapshots, so interval boundaries are crossed
        mid = _scrape(port)
        final = work.worker.drain_stats()  # the tail since the last snapshot
        if final is not None:
            exporter.observe(final)
        got = _scrape(port)
    finally:
        exporter.stop()
    t = wl.truth
    assert t.misses > 0 and t.hits > 0 and len(wl.finished) > 0
    lab = (("engine", "0"), ("model_name", "hisparse"))
    assert got[("vllm:hisparse_cache_hits_total", lab)] == t.hits
    assert got[("vllm:hisparse_cache_misses_total", lab)] == t.misses
    assert got[("vllm:hisparse_host_to_device_bytes_total", lab)] == t.bytes
    # Nothing lost at interval boundaries: the deltas reported mid-run are a prefix of the truth.
    assert mid[("vllm:hisparse_cache_hits_total", lab)] == sum(d["hits"] for d in t.deltas)
    assert 0 <= got[("vllm:hisparse_host_pool_usage", lab)] <= 1
    assert got[("vllm:hisparse_hot_rows_in_use", lab)] > 0


def test_exporter_lifecycle_and_errors():
    ex = HiSparseMetricsExporter(engine_indexes=(0, 3), model_name="m")
    with pytest.raises(ValueError, match="port"):
        ex.start(70000)
    port = ex.start(0)
    with pytest.raises(RuntimeError, match="already serving"):
        ex.start(0)
    blocked = HiSparseMetricsExporter()
    with pytest.raises(OSError, match="cannot serve HiSparse metrics"):
        blocked.start(port)
    ex.observe(None)
    ex.observe({"hits": [2], "misses": [1], "host_to_device_bytes": [16]}, 3)
    assert (
        _scrape(port)[("vllm:hisparse_cache_hits_total", (("engine", "3"), ("model_name", "m")))]
        == 2
    )
    ex.stop()
    ex.stop()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with pytest.raises(ValueError, match="engine_indexes"):
        HiSparseMetricsExporter(engine_indexes=())
    # Two exporters never collide: each owns its registry.
    a, b = HiSparseMetricsExporter(), HiSparseMetricsExporter()
    a.observe({"hits": [5], "misses": [0], "host_to_device_bytes": [0]})
    assert b'vllm:hisparse_cache_hits_total{engine="0",model_name="hisparse"} 0.0' in b.render()
