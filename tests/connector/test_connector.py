"""The connector (vLLM-free, and vLLM's class): roles, config validation, scheduler metadata,
request lifecycle."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from hisparse.connector import ConnectorRole, HiSparseConnectorImpl, StepSchedule
from hisparse.connector.config import HiSparseConfigError
from hisparse.connector.stats import HiSparseKVConnectorStats
from hisparse.connector.worker import HiSparseConnectorMetadata
from hisparse.vllm.compat import KVConnectorRole
from hisparse.vllm.connector import HiSparseConnector
from hisparse.vllm.settings import config_from_extra
from tests.helpers import connector_impl, vllm_connector
from tests.telemetry_helpers import make_pair


def _req(rid):
    return SimpleNamespace(request_id=rid)


# ------------------------------------------------------------------ config
def test_config_defaults():
    c = config_from_extra(None)
    assert (c.top_k, c.hot_size, c.index_share, c.metrics_interval) == (
        2048,
        4096,
        1,
        2000,
    )
    assert config_from_extra({"top_k": 64}).hot_size == 128


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"hot_size": 4}, "hot_size"),
        ({"top_k": "2048"}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": 64, "hot_size": 32}, "hot_size"),
        ({"hot_size": 32769}, "hot_size"),
        ({"top_k": 40000, "hot_size": 40000}, "hot_size"),
        ({"index_share": 0}, "index_share"),
        ({"metrics_interval": 2.5}, "metrics_interval"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"block_size": None}, "block_size"),
        ({"host_pool_gib": 0}, "host_pool_gib"),
        ({"host_pool_gib": float("nan")}, "host_pool_gib"),
        ({"host_pool_gib": "64"}, "host_pool_gib"),
        ({"pin_host_pool": "yes"}, "pin_host_pool"),
    ],
)
def test_config_errors_name_the_key(extra, key):
    with pytest.raises(HiSparseConfigError, match=rf"kv_connector_extra_config\['{key}'\]"):
        config_from_extra(extra)


def test_config_rejects_non_mapping():
    with pytest.raises(HiSparseConfigError, match="mapping"):
        config_from_extra([("top_k", 4)])


def test_connector_validates_extra_config_and_takes_vllm_defaults():
    with pytest.raises(HiSparseConfigError, match=r"\['topk'\]"):
        connector_impl({"topk": 4}, role="worker")
    kv = SimpleNamespace(kv_connector_extra_config={"top_k": 8}, kv_role="kv_both")
    vc = SimpleNamespace(
        kv_transfer_config=kv,
        scheduler_config=SimpleNamespace(max_num_seqs=7),
        cache_config=SimpleNamespace(block_size=64),
    )
    c = HiSparseConnector(vc, KVConnectorRole.SCHEDULER, None)
    assert c.config.max_num_seqs == 7 and c.config.block_size == 64 and c.config.top_k == 8
    kv.kv_connector_extra_config = {"top_k": 8, "max_num_seqs": 3}
    assert HiSparseConnector(vc, "scheduler").config.max_num_seqs == 3  # explicit wins
    with pytest.raises(ValueError, match="kv_transfer_config"):
        HiSparseConnector(SimpleNamespace(kv_transfer_config=None), "worker")
    with pytest.raises(ValueError, match="role"):
        connector_impl({}, role="driver")


# ------------------------------------------------------------------- roles
def test_every_abstract_method_is_implemented():
    assert not inspect.isabstract(HiSparseConnector)
    assert not getattr(HiSparseConnector, "__abstractmethods__", set())


def test_roles():
    sched = connector_impl({"top_k": 4, "hot_size": 8}, "scheduler")
    work = connector_impl({"top_k": 4, "hot_size": 8}, KVConnectorRole.WORKER)
    assert sched.role == ConnectorRole.SCHEDULER and sched.worker is None
    assert work.role == ConnectorRole.WORKER and work.worker is not None
    assert sched.get_kv_connector_stats() is None  # no worker: None
    assert work.get_kv_connector_stats() is None  # nothing registered yet
    with pytest.raises(RuntimeError, match="worker-side"):
        sched.register_kv_caches({})
    with pytest.raises(RuntimeError, match="scheduler-side"):
        work.build_connector_meta(StepSchedule({}))
    with pytest.raises(RuntimeError, match="bind_connector_metadata"):
        work.start_load_kv(None)
    sched.shutdown()  # nothing to release


def test_hisparse_meaning_of_the_load_api():
    sched, work, caches = make_pair()
    assert sched.get_num_new_matched_tokens(_req("a"), 0) == (0, False)
    assert sched.get_num_new_matched_tokens(_req("a"), 100) == (0, False)
    assert sched.update_state_after_alloc(_req("a"), [], 0) is None
    assert work.get_finished({"a"}) == (None, None)
    assert work.wait_for_save() is None
    assert sched.request_finished(_req("never-seen"), [1, 2]) == (False, None)
    vllm_sched = vllm_connector({"top_k": 4}, "scheduler")
    assert vllm_sched.request_finished_all_groups(_req("never-seen"), ([1],)) == (False, None)


# ------------------------------------------------- scheduler-side metadata
def test_state_rows_assigned_reset_released_and_reused():
    sched = connector_impl({"top_k": 4, "hot_size": 8, "max_num_seqs": 2}, "scheduler")
    m1 = sched.build_connector_meta(StepSchedule({"a": 5, "b": 3}))
    assert isinstance(m1, HiSparseConnectorMetadata)
    assert m1.req_ids == ("a", "b") and set(m1.state_rows) == {0, 1}
    assert set(m1.reset_rows) == {0, 1} and m1.host_rows_in_use == 8
    m2 = sched.build_connector_meta(StepSchedule({"b": 1, "a": 1}))
    assert m2.req_ids == ("b", "a") and m2.state_rows == (m1.state_rows[1], m1.state_rows[0])
    assert m2.reset_rows == () and m2.host_rows_in_use == 10
    with pytest.raises(RuntimeError, match=r"max_num_seqs'\] = 2"):
        sched.build_connector_meta(StepSchedule({"a": 1, "b": 1, "c": 1}))
    row_a = m1.state_rows[0]
    assert sched.request_finished(_req("a"), []) == (False, None)
    m3 = sched.build_connector_meta(StepSchedule({"c": 2}))
    assert m3.state_rows == (row_a,) and m3.reset_rows == (row_a,)  # released, handed over
    assert m3.host_rows_in_use == 4 + 2  # b: 3 + 1 (the failed step added nothing), c: 2
    # finished_req_ids / preempted_req_ids in the scheduler output also release rows.
    m4 = sched.build_connector_meta(
        StepSchedule({}, finished_req_ids={"b"}, preempted_req_ids={"c"})
    )
    assert set(m4.reset_rows) == {0, 1} and m4.req_ids == () and m4.host_rows_in_use == 0
    with pytest.raises(ValueError, match="num_scheduled_tokens"):
        sched.build_connector_meta(SimpleNamespace(num_scheduled_tokens=None))


def _step(sched, work, reqs, top):
    meta = sched.build_connector_meta(StepSchedule({r: 1 for r in reqs}))
    work.bind_connector_metadata(meta)
    work.start_load_kv(None)
    w = work.worker
    for name in w.layer_names:
        work.resolve(name, torch.tensor(top, dtype=torch.int32))
        work.wait_for_layer_load(name)
    work.clear_connector_metadata()
    return w.drain_stats().totals()


def test_finishing_a_request_releases_its_hot_state():
    sched, work, caches = make_pair({"max_num_seqs": 1, "index_share": 3})
    assert _step(sched, work, ["a"], [[1, 2, 3, 4]])["misses"] == 4
    assert _step(sched, work, ["a"], [[1, 2, 3, 4]]) == {
        "hits": 4,
        "misses": 0,
        "host_to_device_bytes": 0,
    }
    sched.request_finished(_req("a"), [])
    # b gets a's state row; a's hot rows must not serve b (they are reset).
    t = _step(sched, work, ["b"], [[1, 2, 3, 4]])
    assert t["hits"] == 0 and t["misses"] == 4
    assert int((work.worker.groups[0].slot_keys >= 0).sum()) == 4


def test_invalidate_keys_turns_a_hit_into_a_miss():
    sched, work, caches = make_pair({"max_num_seqs": 1, "index_share": 3})
    _step(sched, work, ["a"], [[1, 2, 3, 4]])
    sched.invalidate_keys("a", [2])
    t = _step(sched, work, ["a"], [[1, 2, 3, 4]])
    assert t["hits"] == 3 and t["misses"] == 1
    with pytest.raises(ValueError, match="holds no HiSparse state row"):
        sched.invalidate_keys("zzz", [1])


def test_save_kv_layer_reads_slot_mapping_from_attn_metadata():
    sched, work, caches = make_pair()
    name = work.worker.layer_names[0]
    rows = torch.full((2, 32), 7, dtype=torch.uint8)
    work.save_kv_layer(name, rows, SimpleNamespace(slot_mapping=torch.tensor([3, 9])))
    host = work.worker.host_view(name)
    assert torch.equal(host[3], rows[0]) and torch.equal(host[9], rows[1])
    with pytest.raises(ValueError, match="slot_mapping"):
        work.save_kv_layer(name, rows, SimpleNamespace())


def test_build_kv_connector_stats_and_prom_metrics_are_classmethods():
    assert HiSparseConnectorImpl.build_kv_connector_stats(None).is_empty()
    assert HiSparseConnector.build_kv_connector_stats(None).is_empty()
    s = HiSparseConnector.build_kv_connector_stats(
        {"hits": [1], "misses": [2], "host_to_device_bytes": [3]}
    )
    assert isinstance(s, HiSparseKVConnectorStats) and s.totals()["misses"] == 2


def test_shutdown_through_connector_releases_worker():
    sched, work, caches = make_pair()
    pool = work.worker.host_pool
    work.shutdown()
    work.shutdown()
    assert pool.released and work.worker.is_shut_down
