"""HiSparseConnectorWorker: two-phase event-gated sampling, exact bytes, binding, shutdown."""

from __future__ import annotations

import pytest
import torch

from hisparse.connector import StepSchedule
from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.connector.sampler import DeviceHooks
from hisparse.connector.worker import HiSparseConnectorMetadata, HiSparseConnectorWorker
from hisparse.runtime.views import BindingError
from tests.helpers import connector_impl
from tests.telemetry_helpers import Workload, make_pair


def _u64(t):
    return [int(x) for x in t.tolist()]


class SpyEvent:
    def __init__(self, log):
        self.log, self.done, self.records = log, True, 0

    def record(self, stream=None):
        self.records += 1
        self.log.append(("event.record", stream))

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


class SpyStream:
    """Stands in for a CUDA stream; logs the counters' state at each wait."""

    def __init__(self, name, log, group):
        self.name, self.log, self.group = name, log, group

    def wait_stream(self, other):
        g = self.group
        self.log.append(
            (f"{self.name}.wait_stream({other.name})", _u64(g.counters), _u64(g.counters_host))
        )

    def synchronize(self):
        pass


class Spies:
    """Stand-ins for the CUDA stream/event/capture plumbing, injected into the worker's counter
    sampler (``device_hooks``) to observe the ordering on a CPU worker."""

    def __init__(self):
        self.log = []
        self.event = SpyEvent(self.log)
        self.compute = None
        self.capturing = False
        self.hooks = DeviceHooks(
            compute_stream=lambda: self.compute,
            make_event=lambda: self.event,
            is_capturing=lambda: self.capturing,
        )

    def install_streams(self, worker):
        """The groups' copy streams and the compute stream become spies (after registration)."""
        g = worker.groups[0]
        self.compute = SpyStream("compute", self.log, g)
        for grp in worker.groups:
            grp.copy_stream = SpyStream(f"copy[{grp.name}]", self.log, g)
        return self.log, self.event


def _drive_without_stats(wl, steps):
    """Workload steps whose per-step stats call is made by the test, not the workload."""
    orig = wl.work.get_kv_connector_stats
    wl.work.get_kv_connector_stats = lambda: None
    try:
        for _ in range(steps):
            wl.step()
    finally:
        wl.work.get_kv_connector_stats = orig


def test_first_call_returns_none_and_arms_with_ordering_both_ways():
    spies = Spies()
    sched, work, caches = make_pair(
        {"metrics_interval": 1, "index_share": 1}, row_bytes=(32, 64), device_hooks=spies.hooks
    )
    w = work.worker
    wl = Workload(sched, work, caches, seed=3)
    _drive_without_stats(wl, 6)
    before = [_u64(g.counters) for g in w.groups]
    assert sum(sum(c) for c in before) > 0
    log, ev = spies.install_streams(w)

    assert w.get_kv_connector_stats() is None  # nothing pending yet: first call arms
    assert w.sampler.pending and ev.records == 1
    # Device counters were copied to the pinned host buffers, then zeroed.
    for g, b in zip(w.groups, before):
        assert _u64(g.counters_host) == b
        assert _u64(g.counters) == [0, 0, 0]
    names = [e[0] for e in log]
    n = len(w.groups)
    # compute waits for every copy stream first (before the copy: host copy still old) ...
    assert names[:n] == [f"compute.wait_stream(copy[{g.name}])" for g in w.groups]
    first = w.groups[0]
    assert log[0][1] == before[0] and log[0][2] != before[0]
    # ... then every copy stream waits for compute (after the copy and the zeroing) ...
    assert names[n : 2 * n] == [f"copy[{g.name}].wait_stream(compute)" for g in w.groups]
    assert log[n][1] == [0, 0, 0] and log[n][2] == _u64(first.counters_host)
    # ... and the event is recorded last, on the compute stream.
    assert names[-1] == "event.record" and log[-1][1].name == "compute"

    stats = w.get_kv_connector_stats()  # the snapshot completed: exactly the counts
    assert stats is not None
    assert stats.data["hits"] == [sum(b[0] for b in before)]
    assert stats.data["misses"] == [sum(b[1] for b in before)]
    assert stats.data["host_to_device_bytes"] == [sum(b[2] for b in before)]
    assert stats.totals() == {
        "hits": wl.truth.hits,
        "misses": wl.truth.misses,
        "host_to_device_bytes": wl.truth.bytes,
    }


def test_later_call_returns_exact_counts_and_nothing_happened_is_none():
    sched, work, caches = make_pair({"metrics_interval": 2, "metrics_seconds": 0})
    w = work.worker
    assert w.get_kv_connector_stats() is None
    assert w.get_kv_connector_stats() is None  # arms (2nd call) with all-zero counters
    assert w.sampler.pending
    assert w.get_kv_connector_stats() is None  # harvest of an all-zero snapshot: None
    assert not w.sampler.pending
    wl = Workload(sched, work, caches, seed=4)
    _drive_without_stats(wl, 5)
    got = []
    for _ in range(6):
        s = w.get_kv_connector_stats()
        if s is not None:
            got.append(s)
    assert len(got) == 1
    assert got[0].data["hits"] == [wl.truth.hits] and got[0].data["misses"] == [wl.truth.misses]
    assert got[0].data["host_to_device_bytes"] == [wl.truth.bytes]
    assert got[0].data["hot_rows_in_use"][0] > 0
    assert 0 < got[0].data["host_pool_usage"][0] <= 1


def test_capture_suppresses_arming():
    spies = Spies()
    spies.capturing = True
    sched, work, caches = make_pair({"metrics_interval": 2}, device_hooks=spies.hooks)
    w = work.worker
    wl = Workload(sched, work, caches, seed=5)
    while wl.truth.hits + wl.truth.misses == 0:
        _drive_without_stats(wl, 1)
    for _ in range(6):
        assert w.get_kv_connector_stats() is None
        assert not w.sampler.pending
    counts = [sum(x) for x in zip(*(_u64(g.counters) for g in w.groups))]
    assert counts[0] + counts[1] > 0  # untouched while capturing
    spies.capturing = False
    w.get_kv_connector_stats()  # 7th call: not on the interval
    assert not w.sampler.pending
    w.get_kv_connector_stats()  # 8th: arms
    assert w.sampler.pending and _u64(w.groups[0].counters) == [0, 0, 0]
    # A completed snapshot is not harvested (no event query) while a capture is in progress.
    spies.capturing = True
    assert w.get_kv_connector_stats() is None and w.sampler.pending
    spies.capturing = False
    s = w.get_kv_connector_stats()
    assert s is not None and s.totals()["hits"] + s.totals()["misses"] == sum(counts[:2])


def test_pending_suppresses_arming_and_is_harvested_when_complete():
    spies = Spies()
    sched, work, caches = make_pair({"metrics_interval": 1}, device_hooks=spies.hooks)
    w = work.worker
    wl = Workload(sched, work, caches, seed=6)
    _drive_without_stats(wl, 4)
    log, ev = spies.install_streams(w)
    assert w.get_kv_connector_stats() is None
    assert ev.records == 1
    snap = [_u64(g.counters_host) for g in w.groups]
    ev.done = False  # the copy has not landed yet
    for g in w.groups:  # the runtime's own resolve/gather must not see the fake streams
        g.copy_stream = None
    _drive_without_stats(wl, 3)  # more work while pending
    for _ in range(4):
        assert w.get_kv_connector_stats() is None  # not complete: nothing returned
    assert ev.records == 1  # and no new snapshot armed over the pending one
    assert [_u64(g.counters_host) for g in w.groups] == snap
    ev.done = True
    s = w.get_kv_connector_stats()
    assert s is not None and s.data["hits"] == [sum(x[0] for x in snap)]
    assert ev.records == 2  # the same call re-armed (interval 1)
    s2 = w.get_kv_connector_stats()
    assert s.totals()["misses"] + s2.totals()["misses"] == wl.truth.misses


def test_count_advances_without_forward_passes():
    sched, work, caches = make_pair({"metrics_interval": 5})
    w = work.worker
    wl = Workload(sched, work, caches, seed=7)
    _drive_without_stats(wl, 3)
    for _ in range(4):  # idle steps: no forward, the count still advances
        assert w.get_kv_connector_stats() is None
    assert w.sampler.calls == 4 and not w.sampler.pending
    assert w.get_kv_connector_stats() is None  # 5th call arms
    assert w.sampler.calls == 5 and w.sampler.pending
    s = w.get_kv_connector_stats()
    assert s.totals() == {
        "hits": wl.truth.hits,
        "misses": wl.truth.misses,
        "host_to_device_bytes": wl.truth.bytes,
    }


def test_bytes_are_exact_per_member_row_bytes_not_an_estimate():
    # A group whose members have different row sizes: bytes = rows copied x each layer's bytes.
    sched, work, caches = make_pair(
        {"index_share": 3, "metrics_interval": 1000}, row_bytes=(16, 96, 48)
    )
    w = work.worker
    assert len(w.groups) == 1 and w.groups[0].stats_row_bytes == 160
    wl = Workload(sched, work, caches, seed=8)
    _drive_without_stats(wl, 12)
    s = w.drain_stats()
    assert s.totals()["host_to_device_bytes"] == wl.truth.bytes == wl.truth.misses * 160
    # The independent count is not vacuous.
    assert wl.truth.misses > 0 and wl.truth.hits > 0


def test_out_of_range_rows_are_not_counted_as_moved():
    sched, work, caches = make_pair({"index_share": 1, "metrics_interval": 1000}, row_bytes=(32,))
    w = work.worker
    meta = sched.build_connector_meta(StepSchedule({"a": 1}))
    work.bind_connector_metadata(meta)
    work.start_load_kv(None)
    # Keys outside the host pool are padding: neither counted nor copied.
    top = torch.tensor([[0, 1, w.host_rows + 5, -1]], dtype=torch.int32)
    work.resolve("model.layers.0.attn", top)
    s = w.drain_stats()
    assert s.totals() == {"hits": 0, "misses": 2, "host_to_device_bytes": 64}


def test_register_checks_name_the_problem():
    cfg = HiSparseConfig(top_k=4, hot_size=8, max_num_seqs=2, host_pool_gib=0.001)
    w = HiSparseConnectorWorker(cfg)
    with pytest.raises(BindingError, match="hot buffers need"):
        w.register_kv_caches({"l0": torch.zeros(15, 32, dtype=torch.uint8)})
    with pytest.raises(BindingError, match="16-byte aligned"):
        w.register_kv_caches({"l0": torch.zeros(16, 24, dtype=torch.uint8)})
    with pytest.raises(BindingError, match="contiguous"):
        w.register_kv_caches({"l0": torch.zeros(32, 16, dtype=torch.uint8).t()})
    with pytest.raises(BindingError, match="same number of rows"):
        w.register_kv_caches(
            {
                "a": torch.zeros(16, 32, dtype=torch.uint8),
                "b": torch.zeros(20, 32, dtype=torch.uint8),
            }
        )
    with pytest.raises(ValueError, match="non-empty"):
        w.register_kv_caches({})
    tiny = HiSparseConnectorWorker(
        HiSparseConfig(top_k=4, hot_size=8, max_num_seqs=2, host_pool_gib=1e-7)
    )
    with pytest.raises(HiSparseConfigError, match=r"\['host_pool_gib'\]"):
        tiny.register_kv_caches({"l0": torch.zeros(16, 32, dtype=torch.uint8)})
    # bf16 caches are viewed as bytes: [rows, 16] bf16 = 32-byte rows; extra rows = resident tier.
    w.register_kv_caches({"l0": torch.zeros(20, 16, dtype=torch.bfloat16)})
    assert w.runtime("l0").row_bytes == 32 and w.hot_base == 4
    with pytest.raises(RuntimeError, match="already"):
        w.register_kv_caches({"l0": torch.zeros(16, 32, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="not a registered HiSparse layer"):
        w.runtime("nope")


def test_step_api_errors():
    sched, work, caches = make_pair()
    w = work.worker
    names = w.layer_names
    unregistered = HiSparseConnectorWorker(work.config)
    with pytest.raises(RuntimeError, match="register_kv_caches"):
        unregistered.start_step(HiSparseConnectorMetadata())
    assert unregistered.get_kv_connector_stats() is None
    with pytest.raises(ValueError, match="exceeds max_num_seqs"):
        w.start_step(
            HiSparseConnectorMetadata(req_ids=("a", "b", "c", "d"), state_rows=(0, 1, 2, 0))
        )
    with pytest.raises(ValueError, match="equal lengths"):
        HiSparseConnectorMetadata(req_ids=("a",), state_rows=())
    w.start_step(HiSparseConnectorMetadata(req_ids=("a",), state_rows=(0,)))
    top = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="has not resolved this step"):
        w.resolve(names[1], top)  # follower before its leader
    out = w.resolve(names[0], top).clone()
    assert torch.equal(w.resolve(names[1], top), out)
    with pytest.raises(ValueError, match="must be on the CPU or on the rows. device"):
        w.save_kv_layer(
            names[0],
            torch.zeros(1, 32, dtype=torch.uint8),
            torch.zeros(1, dtype=torch.int32, device="meta"),
        )
    with pytest.raises(ValueError, match="slot_mapping has"):
        w.save_kv_layer(names[0], torch.zeros(2, 32, dtype=torch.uint8), [1])
    with pytest.raises(ValueError, match="outside the host pool"):
        w.save_kv_layer(names[0], torch.zeros(1, 32, dtype=torch.uint8), [w.host_rows])
    with pytest.raises(ValueError, match="whole number"):
        w.save_kv_layer(names[0], torch.zeros(1, 33, dtype=torch.uint8), [0])
    # Padding slots (-1) are skipped; real ones land in the host pool.
    w.save_kv_layer(names[0], torch.full((2, 32), 9, dtype=torch.uint8), [-1, 5])
    assert int(w.host_view(names[0])[5].min()) == 9


def test_follower_returns_leaders_rows_this_step():
    sched, work, caches = make_pair({"index_share": 2}, row_bytes=(32, 32))
    w = work.worker
    a, b = w.layer_names
    w.start_step(HiSparseConnectorMetadata(req_ids=("x",), state_rows=(1,)))
    top = torch.tensor([[3, 4, 5, 6]], dtype=torch.int32)
    out = w.resolve(a, top).clone()
    assert torch.equal(w.resolve(b, top), out)
    w.start_step(HiSparseConnectorMetadata(req_ids=("x",), state_rows=(1,)))
    with pytest.raises(RuntimeError, match="has not resolved"):
        w.resolve(b, top)  # a new step: the follower waits for the leader again


def test_shutdown_drains_pending_releases_and_is_idempotent():
    sched, work, caches = make_pair({"metrics_interval": 2})
    w = work.worker
    wl = Workload(sched, work, caches, seed=9)
    for _ in range(7):
        wl.step()
    pool = w.host_pool
    # A snapshot may be pending and counts accumulated after it: none may be dropped.
    work.shutdown()
    final = w.final_stats
    total = {
        k: sum(d[k] for d in wl.truth.deltas) + (final.totals()[k] if final else 0)
        for k in ("hits", "misses", "host_to_device_bytes")
    }
    assert total == {
        "hits": wl.truth.hits,
        "misses": wl.truth.misses,
        "host_to_device_bytes": wl.truth.bytes,
    }
    assert pool.released and w.host_pool is None and w.runtimes == {} and w.groups == []
    assert w.is_shut_down
    work.shutdown()  # harmless
    assert w.shutdown() is final
    assert work.get_kv_connector_stats() is None
    with pytest.raises(RuntimeError, match="shut down"):
        w.start_step(HiSparseConnectorMetadata())
    with pytest.raises(RuntimeError, match="shut down"):
        w.register_kv_caches(caches)


def test_shutdown_before_register_is_harmless():
    w = HiSparseConnectorWorker(HiSparseConfig(top_k=4, hot_size=8))
    assert w.shutdown() is None and w.shutdown() is None


def test_follower_gathers_after_its_own_save_in_per_layer_order():
    """Per layer: save this step's row, then resolve and attend. A follower must not gather
    before its own save, or it caches an unwritten host row as a hit (index_share 2)."""
    from hisparse.connector import StepSchedule

    extra = {
        "top_k": 4,
        "hot_size": 8,
        "max_num_seqs": 1,
        "block_size": 4,
        "host_pool_gib": 16 * 64 * 2 / 2**30,
        "index_share": 2,
    }
    worker = connector_impl(extra, role="worker")
    sched = connector_impl(extra, role="scheduler")
    bufs = {n: torch.zeros(8, 64, dtype=torch.uint8) for n in ("L0", "L1")}
    worker.register_kv_caches(bufs)
    for pos in range(3):
        meta = sched.build_connector_meta(StepSchedule({"a": 1}))
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        sel = list(range(pos + 1))
        top_k = torch.tensor([sel + [-1] * (4 - len(sel))], dtype=torch.int32)
        for name, base in (("L0", 10), ("L1", 20)):
            worker.save_kv_layer(
                name, torch.full((1, 64), base + pos, dtype=torch.uint8), None, slot_mapping=[pos]
            )
            out = worker.resolve(name, top_k)
            if name == "L1":
                worker.resolve(name, top_k)  # a follower's repeat neither copies nor counts
            worker.wait_for_layer_load(name)
            got = bufs[name][out[0, : len(sel)].long(), 0].tolist()
            assert got == [base + p for p in sel], (pos, name, got)
        worker.clear_connector_metadata()
    stats = worker.worker.drain_stats()
    assert sum(stats.data["host_to_device_bytes"]) == 2 * 3 * 64  # each row once per layer


def test_register_refuses_overlapping_caches_and_misfit_pinning():
    import pytest

    from hisparse.connector.config import HiSparseConfigError
    from hisparse.runtime.views import BindingError

    extra = {
        "top_k": 4,
        "hot_size": 8,
        "max_num_seqs": 1,
        "block_size": 4,
        "host_pool_gib": 16 * 64 * 2 / 2**30,
    }
    shared = torch.zeros(8, 64, dtype=torch.uint8)
    w = connector_impl(extra, role="worker")
    with pytest.raises(BindingError, match="overlap"):
        w.register_kv_caches({"L0": shared, "L1": shared})
    w = connector_impl(dict(extra, pin_host_pool=True), role="worker")
    with pytest.raises(HiSparseConfigError, match=r"\['pin_host_pool'\]"):
        w.register_kv_caches({"L0": torch.zeros(8, 64, dtype=torch.uint8)})


def test_host_pool_is_token_major_within_each_index_group():
    """A group's member layers share each token's host row (each member a strided view of it), so
    one host page serves every member's gather; groups follow one another; the pool is covered
    exactly, with no byte shared between layers."""
    sched, work, caches = make_pair({"index_share": 2}, row_bytes=(32, 64, 48))
    w = work.worker
    (a, b, c), N = w.layer_names, w.host_rows
    va, vb, vc = (w.host_view(n) for n in (a, b, c))
    assert va.stride() == (96, 1) and vb.stride() == (96, 1) and vc.stride() == (48, 1)
    base = w.host_pool.raw.data_ptr()
    assert va.data_ptr() == base and vb.data_ptr() == base + 32
    assert vc.data_ptr() == base + N * 96  # the second group after the first
    assert w.host_pool.raw.numel() == N * (96 + 48)
    # Rows saved through the worker land in their own layer's columns only.
    w.host_pool.raw.zero_()
    w.save_kv_layer(a, torch.full((1, 32), 1, dtype=torch.uint8), [7])
    w.save_kv_layer(b, torch.full((1, 64), 2, dtype=torch.uint8), [7])
    w.save_kv_layer(c, torch.full((1, 48), 3, dtype=torch.uint8), [7])
    raw = w.host_pool.raw
    assert raw[7 * 96 : 7 * 96 + 32].eq(1).all() and raw[7 * 96 + 32 : 8 * 96].eq(2).all()
    assert raw[N * 96 + 7 * 48 : N * 96 + 8 * 48].eq(3).all()
    assert int(raw.ne(0).sum()) == 32 + 64 + 48
    assert va[7].eq(1).all() and vb[7].eq(2).all() and vc[7].eq(3).all()
