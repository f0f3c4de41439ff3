"""HiSparseKVConnectorStats and HiSparsePromMetrics on the KVConnectorStats contract."""

from __future__ import annotations

import functools
import json
import pickle

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hisparse.connector.stats import COUNTER_NAMES, HiSparseKVConnectorStats, HiSparsePromMetrics
from hisparse.vllm.connector import HiSparseConnector


def test_empty_on_creation():
    s = HiSparseKVConnectorStats()
    assert s.is_empty()
    assert all(v == [] for v in s.data.values())
    assert s.reduce()["HiSparse hot-buffer hits"] == 0
    assert s.reduce()["HiSparse hit rate"] == 0.0


def test_record_and_reduce_sums():
    s = HiSparseKVConnectorStats()
    s.record_snapshot(12, 4, 64, host_pool_usage=0.25, hot_rows_in_use=10)
    s.record_snapshot(30, 10, 160, host_pool_usage=0.5, hot_rows_in_use=7)
    assert not s.is_empty()
    assert s.data["hits"] == [12, 30] and s.data["misses"] == [4, 10]
    assert s.data["host_to_device_bytes"] == [64, 160]
    r = s.reduce()
    assert r["HiSparse hot-buffer hits"] == 42
    assert r["HiSparse hot-buffer misses"] == 14
    assert r["HiSparse host-to-device bytes"] == 224
    assert r["HiSparse hit rate"] == round(42 / 56, 4)
    assert r["HiSparse host-pool usage"] == 0.5 and r["HiSparse hot rows in use"] == 7
    s.reset()
    assert s.is_empty()


def test_aggregate_extends_and_skips_empty():
    a = HiSparseKVConnectorStats()
    a.record_snapshot(1, 2, 32)
    b = HiSparseKVConnectorStats()
    b.record_snapshot(3, 4, 64, hot_rows_in_use=5)
    assert a.aggregate(b) is a
    assert a.data["hits"] == [1, 3] and a.data["misses"] == [2, 4]
    assert a.data["host_to_device_bytes"] == [32, 64] and a.data["hot_rows_in_use"] == [5]
    before = {k: list(v) for k, v in a.data.items()}
    a.aggregate(HiSparseKVConnectorStats())
    a.aggregate(None)
    assert a.data == before
    # An empty accumulator takes the other's entries (vLLM's logging path).
    e = HiSparseKVConnectorStats().aggregate(b)
    assert e.data["hits"] == [3]


def test_data_round_trips_through_build_kv_connector_stats():
    s = HiSparseKVConnectorStats()
    s.record_snapshot(5, 6, 96, host_pool_usage=0.1, hot_rows_in_use=3)
    wire = pickle.loads(pickle.dumps(s.to_dict()))  # plain lists: IPC-safe
    json.dumps(wire)
    r = HiSparseConnector.build_kv_connector_stats(wire)
    assert isinstance(r, HiSparseKVConnectorStats)
    assert r.data == s.data and r.reduce() == s.reduce()
    empty = HiSparseConnector.build_kv_connector_stats(None)
    assert isinstance(empty, HiSparseKVConnectorStats) and empty.is_empty()
    # The rebuilt container owns its lists: aggregating does not mutate the wire data.
    r.aggregate(s)
    assert wire["hits"] == [5]


def test_bad_input_names_the_field():
    s = HiSparseKVConnectorStats()
    with pytest.raises(ValueError, match="misses"):
        s.record_snapshot(1, -1, 0)
    with pytest.raises(ValueError, match="hits"):
        s.record_snapshot(1.5, 1, 0)
    with pytest.raises(ValueError, match="host_pool_usage"):
        s.record_snapshot(1, 1, 0, host_pool_usage=1.5)
    with pytest.raises(ValueError, match=r"data\['bogus'\]"):
        HiSparseKVConnectorStats(data={"bogus": [1]})
    with pytest.raises(ValueError, match=r"data\['hits'\] must be a list"):
        HiSparseKVConnectorStats(data={"hits": 3})
    with pytest.raises(ValueError, match="equal lengths"):
        HiSparseKVConnectorStats(data={"hits": [1], "misses": [], "host_to_device_bytes": []})


def _prom(engines=(0, 1)):
    reg = CollectorRegistry()
    types = {c: functools.partial(c, registry=reg) for c in (Gauge, Counter, Histogram)}
    labelvalues = {i: ["m", str(i)] for i in engines}
    return reg, HiSparseConnector.build_prom_metrics(
        None, types, ["model_name", "engine"], labelvalues
    )


def test_prom_observe_increments_per_engine_once_per_delta():
    reg, prom = _prom()
    assert isinstance(prom, HiSparsePromMetrics)
    s = HiSparseKVConnectorStats()
    s.record_snapshot(10, 2, 64, host_pool_usage=0.25, hot_rows_in_use=8)
    s.record_snapshot(5, 1, 32, host_pool_usage=0.5, hot_rows_in_use=9)
    prom.observe(s.data, 1)
    prom.observe(HiSparseKVConnectorStats().data, 0)  # empty: nothing
    val = lambda n, e: reg.get_sample_value(n, {"model_name": "m", "engine": e})  # noqa: E731
    assert val("vllm:hisparse_cache_hits_total", "1") == 15
    assert val("vllm:hisparse_cache_misses_total", "1") == 3
    assert val("vllm:hisparse_host_to_device_bytes_total", "1") == 96
    assert val("vllm:hisparse_cache_hits_total", "0") == 0
    assert val("vllm:hisparse_host_pool_usage", "1") == 0.5
    assert val("vllm:hisparse_hot_rows_in_use", "1") == 9
    prom.observe(s.data, 1)  # observing again adds again: callers pass each delta once
    assert val("vllm:hisparse_cache_hits_total", "1") == 30
    with pytest.raises(KeyError, match="engine_idx 7"):
        prom.observe(s.data, 7)


def test_counter_names_are_the_contract():
    assert COUNTER_NAMES == (
        "vllm:hisparse_cache_hits",
        "vllm:hisparse_cache_misses",
        "vllm:hisparse_host_to_device_bytes",
        "vllm:hisparse_spilled_requests",
        "vllm:hisparse_spilled_rows",
        "vllm:hisparse_spilled_bytes",
        "vllm:hisparse_returned_requests",
        "vllm:hisparse_returned_rows",
    )


_SPILL = dict(
    spilled_requests=2,
    spilled_rows=64,
    spilled_bytes=64 * 656,
    returned_requests=1,
    returned_rows=40,
)


def test_spill_counters_travel_and_reach_prometheus():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    s = HiSparseKVConnectorStats()
    s.record_snapshot(0, 0, 0, **_SPILL)
    s.record_snapshot(3, 1, 656)  # a hot-buffer snapshot without spill deltas
    rebuilt = HiSparseKVConnectorStats(data=dict(s.data))
    assert rebuilt.spill_totals() == _SPILL
    assert rebuilt.totals() == {"hits": 3, "misses": 1, "host_to_device_bytes": 656}
    assert rebuilt.reduce()["HiSparse spilled requests"] == 2
    agg = HiSparseKVConnectorStats().aggregate(rebuilt).aggregate(rebuilt)
    assert agg.spill_totals()["returned_rows"] == 80
    reg = CollectorRegistry()
    types = {c: functools.partial(c, registry=reg) for c in (Gauge, Counter, Histogram)}
    prom = HiSparsePromMetrics(types, ["model_name", "engine"], {0: ["m", "0"]})
    prom.observe(agg.data, 0)
    val = lambda n: reg.get_sample_value(n, {"model_name": "m", "engine": "0"})  # noqa: E731
    assert val("vllm:hisparse_spilled_requests_total") == 4
    assert val("vllm:hisparse_spilled_bytes_total") == 2 * 64 * 656
    assert val("vllm:hisparse_returned_requests_total") == 2
    assert val("vllm:hisparse_returned_rows_total") == 80


def test_spill_counters_are_recorded_together_and_validated():
    s = HiSparseKVConnectorStats()
    with pytest.raises(ValueError, match="recorded together"):
        s.record_snapshot(0, 0, 0, spilled_requests=1)
    with pytest.raises(ValueError, match="spilled_rows"):
        s.record_snapshot(0, 0, 0, **{**_SPILL, "spilled_rows": -1})
    with pytest.raises(ValueError, match="equal lengths"):
        HiSparseKVConnectorStats(data={"spilled_requests": [1], "spilled_rows": []})
