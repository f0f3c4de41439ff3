"""TP ranks sharing one host pool (``tp_pool``), two workers of one process standing in for two
ranks: rank 0 writes the rows, rank 1 waits for them instead of writing, reads rank 0's rows
(prefill reads and its own gathers), and one pool backs both. One pool per rank where sharing is
not wanted or not possible; ``share_host_pool = true`` that cannot be met refused in one line."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from hisparse.connector import tp_pool
from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.connector.worker import HiSparseConnectorMetadata, HiSparseConnectorWorker
from hisparse.runtime.host_pool import HostPool, HostPoolError
from hisparse.runtime.pool_fence import arch_shares_pool
from hisparse.runtime.shared_pool import SharedHostPool

pytestmark = pytest.mark.skipif(not arch_shares_pool(), reason="shared on x86-64 only")
S, H, ROW = 2, 8, 32
NAMES = ("l0", "l1")


class Group:
    """The ranks' meeting point: what ``hisparse.vllm.compat``'s TP group does over gloo."""

    def __init__(self, world: int) -> None:
        self.world, self.box = world, {}
        self.barrier = threading.Barrier(world, timeout=20)


class Peers:
    def __init__(self, group: Group, rank: int) -> None:
        self.g, self.rank, self.world_size = group, rank, group.world

    def broadcast(self, obj):
        if self.rank == 0:
            self.g.box["b"] = obj
        self.g.barrier.wait()
        got = self.g.box["b"]
        self.g.barrier.wait()
        return got

    def all_agree(self, flag):
        self.g.box[self.rank] = flag
        self.g.barrier.wait()
        got = all(self.g.box[r] for r in range(self.world_size))
        self.g.barrier.wait()
        return got


def _ranks(fn, world=2) -> list:
    """``fn(rank, peers)`` on every rank at once (threads): results, or the exception raised."""
    group, out = Group(world), [None] * world

    def run(r):
        try:
            out[r] = fn(r, Peers(group, r))
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _workers(**over) -> list:
    cfg = HiSparseConfig(top_k=4, hot_size=H, max_num_seqs=S, block_size=4, **over)

    def build(rank, peers):
        w = HiSparseConnectorWorker(cfg)
        hot = {n: torch.zeros(S * H, ROW, dtype=torch.uint8) for n in NAMES}
        w.register_kv_caches(hot, host_rows=16, groups=[list(NAMES)], peers=peers)
        return w

    return _ranks(build)


def test_rank_0_writes_the_other_rank_waits_and_reads_the_same_rows(caplog):
    caplog.set_level("INFO", logger="vllm.hisparse")
    w0, w1 = _workers()
    assert "shared by TP ranks 0-1 (one copy in host RAM" in caplog.text
    assert isinstance(w0.host_pool, SharedHostPool) and isinstance(w1.host_pool, SharedHostPool)
    assert w0.host_pool.info == w1.host_pool.info  # one segment
    meta = HiSparseConnectorMetadata(req_ids=("a",), state_rows=(0,))
    slots = [0, 1, 2, 3]
    w0.start_step(meta)
    w1.start_step(meta)
    done = threading.Event()

    def rank1():  # its rows differ only so that a write of its own would show
        w1.save_kv_layer("l0", torch.full((4, ROW), 9, dtype=torch.uint8), slots)
        done.set()

    t = threading.Thread(target=rank1)
    t.start()
    assert not done.wait(0.1)  # waits for rank 0's rows of this step
    w0.save_kv_layer("l0", torch.full((4, ROW), 5, dtype=torch.uint8), slots)
    assert done.wait(5)
    t.join()
    assert bool((w1.host_view("l0")[:4] == 5).all())  # rank 0's rows; rank 1 wrote nothing
    for w, rows in ((w0, 6), (w1, 1)):
        w.save_kv_layer("l1", torch.full((4, ROW), rows, dtype=torch.uint8), slots)
    top = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    where = w1.resolve("l0", top).long()  # rank 1 gathers into its own hot rows
    assert bool((w1.hot_view("l0")[where[0]] == 5).all())
    assert bool((w1.hot_view("l1")[w1.resolve("l1", None).long()[0]] == 6).all())
    for w in (w0, w1):
        w.end_step()
    w0.start_step(meta)  # rank 1 finished step 1: rank 0 goes on
    for w in (w1, w0):
        w.shutdown()
    assert w0.host_pool is None and w1.is_shut_down


def test_one_pool_per_rank_when_asked_or_without_a_group(caplog):
    caplog.set_level("INFO", logger="vllm.hisparse")
    for w in _workers(share_host_pool=False):
        assert isinstance(w.host_pool, HostPool)
    assert "in each of 2 TP ranks (not shared: kv_connector_extra_config" in caplog.text
    w = HiSparseConnectorWorker(HiSparseConfig(top_k=4, hot_size=H, max_num_seqs=S))
    w.register_kv_caches({"l0": torch.zeros(S * H, ROW, dtype=torch.uint8)}, host_rows=8)
    assert isinstance(w.host_pool, HostPool)  # TP 1, as before


def test_share_host_pool_true_that_cannot_be_met_is_one_line(monkeypatch):
    cfg = HiSparseConfig(top_k=4, hot_size=H, share_host_pool=True)
    peers = Peers(Group(2), 0)
    with pytest.raises(HiSparseConfigError, match=r"\['share_host_pool'\] = true needs the KV"):
        tp_pool.make_pool(
            cfg, torch.device("xpu"), 64, 1, peers, row_bytes=[64], pin=True, what="p"
        )
    monkeypatch.setattr(tp_pool.fence_kernels, "triton", None)
    with pytest.raises(HiSparseConfigError, match="true on CUDA needs Triton: pip install triton"):
        tp_pool.make_pool(
            cfg, torch.device("cuda"), 64, 1, peers, row_bytes=[64], pin=True, what="p"
        )
    monkeypatch.setattr(tp_pool, "arch_shares_pool", lambda: False)
    with pytest.raises(HiSparseConfigError, match="needs an x86-64 CPU"):
        tp_pool.make_pool(
            cfg, torch.device("cpu"), 64, 1, peers, row_bytes=[64], pin=False, what="p"
        )
    with pytest.raises(HiSparseConfigError, match="must be true, false or null"):
        HiSparseConfig(share_host_pool="yes")


def test_a_rank_that_cannot_map_the_segment_falls_back_or_is_refused(monkeypatch):
    def refuse(info, *, what):
        raise HostPoolError("no /proc here")

    monkeypatch.setattr(SharedHostPool, "attach", refuse)
    w0, w1 = _workers()
    assert isinstance(w0.host_pool, HostPool) and isinstance(w1.host_pool, HostPool)
    e0, e1 = _workers(share_host_pool=True)
    assert isinstance(e1, HiSparseConfigError) and "TP rank 1: no /proc here" in str(e1)
    assert isinstance(e0, HiSparseConfigError) and "cannot share it" in str(e0)


@pytest.mark.parametrize("error", [HostPoolError, OSError])
def test_a_pool_rank_0_cannot_allocate_fails_every_rank(monkeypatch, error):
    def refuse(n, c, *, what, remedy="host_pool_gib"):
        raise error("9.00 GiB requested; lower host_pool_gib")

    monkeypatch.setattr(SharedHostPool, "create", refuse)
    e0, e1 = _workers()  # rank 1 is not left waiting for rank 0's segment
    assert isinstance(e0, HostPoolError) and isinstance(e1, HostPoolError)
    assert str(e1).endswith("lower host_pool_gib (on TP rank 0)")


@pytest.mark.parametrize(
    "rank1, match",
    [
        (dict(layers=("l0", "l1", "l2")), r"TP rank 1 has layers 3, TP rank 0 \(the writer\) 2$"),
        (dict(row=2 * ROW), r"has 64-byte rows in layer 0, TP rank 0 \(the writer\) 32$"),
        (dict(host_rows=32), r"has pool bytes 2048, TP rank 0 \(the writer\) 1024$"),
    ],
    ids=["layers", "row-bytes", "pool-size"],
)
def test_a_rank_that_disagrees_with_rank_0_is_refused_not_given_its_own_pool(rank1, match):
    """Its rows would sit elsewhere than rank 0 writes them: no pool of its own mends that."""
    cfg = HiSparseConfig(top_k=4, hot_size=H, max_num_seqs=S, block_size=4)

    def build(rank, peers):
        mine = rank1 if rank == 1 else {}
        names, row = mine.get("layers", NAMES), mine.get("row", ROW)
        hot = {n: torch.zeros(S * H, row, dtype=torch.uint8) for n in names}
        w = HiSparseConnectorWorker(cfg)
        w.register_kv_caches(hot, host_rows=mine.get("host_rows", 16), peers=peers)
        return w

    w0, e1 = _ranks(build)
    assert isinstance(e1, HostPoolError), e1
    assert re.search(match, str(e1)) and "\n" not in str(e1), str(e1)
    assert isinstance(w0.host_pool, HostPool)  # rank 0 goes on alone; rank 1's error stops it
    w0.shutdown()


def test_on_cuda_every_rank_pins_the_one_segment_and_the_gpus_order_it(monkeypatch):
    pinned, started = [], []

    def pin(self, *, what):
        if self.info.pid == -1:  # set below: rank 1's registration fails
            raise HostPoolError("cudaHostRegister failed")
        pinned.append(self.control_address)

    class Fence:  # stands in for DeviceFence (its kernels need a GPU)
        def __init__(self, fence, address, device, *, on_fault):
            self.fence, self.address = fence, address

        def start(self):
            started.append(self.fence.rank)

    monkeypatch.setattr(SharedHostPool, "pin", pin)
    monkeypatch.setattr(tp_pool, "DeviceFence", Fence)
    cfg = HiSparseConfig(top_k=4, hot_size=H)

    def make(rank, peers):
        return tp_pool.make_pool(
            cfg, torch.device("cuda"), 4096, 2, peers, row_bytes=[32, 32], pin=True, what="p"
        )

    (p0, f0), (p1, f1) = _ranks(make)
    assert isinstance(p0, SharedHostPool) and p0.info == p1.info
    assert sorted(started) == [0, 1] and len(pinned) == 2
    assert (f0.fence.rank, f1.fence.rank) == (0, 1) and f0.address == p0.control_address
    for p in (p0, p1):
        p.release()

    real_attach = SharedHostPool.attach

    def attach_unpinnable(info, *, what):
        pool = real_attach(info, what=what)
        object.__setattr__(pool, "info", type(info)(-1, 0, 0, 0, ""))
        return pool

    monkeypatch.setattr(SharedHostPool, "attach", attach_unpinnable)
    monkeypatch.setattr(tp_pool, "HostPool", lambda n, *, pin, what, remedy: ("own", n, pin))
    started.clear()
    (q0, g0), (q1, g1) = _ranks(make)  # rank 1 cannot pin it: a pinned pool per rank
    assert q0 == q1 == ("own", 4096, True) and g0 is g1 is None and not started
