"""The host pool the TP ranks share (``shared_pool``) and the flags that order rank 0's writes
before the other ranks' reads (``pool_fence``): one segment seen by every mapping, nothing left
in /dev/shm, readers that wait for the writer, a writer that waits for its readers, a dead peer
named, and a second process that never sees a row early or overwritten."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from hisparse.runtime.host_pool import HostPoolError
from hisparse.runtime.pool_fence import FenceError, PoolFence, arch_shares_pool, control_bytes
from hisparse.runtime.shared_pool import SEGMENT_NAME, SharedHostPool
from tests.helpers import child_timeout

MIB = 1 << 20
LAYERS = 3
WHAT = "test pool"

needs_x86 = pytest.mark.skipif(not arch_shares_pool(), reason="the pool is shared on x86-64 only")


def _mapped(name=SEGMENT_NAME) -> int:
    with open("/proc/self/maps") as f:
        return sum(name in line for line in f)


def _pair(world=2, layers=LAYERS, pool_bytes=MIB):
    """Rank 0's pool and fence, and rank 1's (attached in this same process)."""
    p0 = SharedHostPool.create(pool_bytes, control_bytes(world, layers), what=WHAT)
    f0 = PoolFence(p0.control, 0, world, layers, timeout=5.0)
    p1 = SharedHostPool.attach(p0.info, what=WHAT)
    f1 = PoolFence(p1.control, 1, world, layers, timeout=5.0)
    p0.close_fd()
    return (p0, f0), (p1, f1)


def test_one_segment_two_mappings_nothing_in_dev_shm():
    before = set(os.listdir("/dev/shm"))
    (p0, _), (p1, _) = _pair()
    assert p0.num_bytes == p1.num_bytes == MIB and p0.raw.numel() == MIB
    assert not p0.pinned and _mapped() == 2
    p0.raw[100:200] = 7
    assert int(p1.raw[100:200].sum()) == 700  # the same bytes, not a copy
    p1.raw[5] = 3
    assert int(p0.raw[5]) == 3
    assert set(os.listdir("/dev/shm")) == before  # an anonymous memfd: no name to leak
    with pytest.raises(HostPoolError, match="cannot open TP rank 0's segment"):
        SharedHostPool.attach(p0.info, what=WHAT)  # rank 0 closed its descriptor
    p0.release()
    assert int(p1.raw[5]) == 3  # still mapped by rank 1
    p1.release()
    p1.release()
    assert p0.released and p1.released and _mapped() == 0


def test_refusals_name_what_to_change():
    with pytest.raises(HostPoolError, match="lower host_pool_gib"):
        SharedHostPool.create(1 << 60, 4096, what=WHAT)
    with pytest.raises(HostPoolError, match="positive number of bytes"):
        SharedHostPool.create(0, 4096, what=WHAT)
    p = SharedHostPool.create(MIB, 4096, what=WHAT)
    with pytest.raises(HostPoolError, match="runs on another host"):
        SharedHostPool.attach(replace(p.info, host="elsewhere/0"), what=WHAT)
    p.release()
    with pytest.raises(ValueError, match="not set up by TP rank 0"):
        q = SharedHostPool.create(MIB, control_bytes(2, 1), what=WHAT)
        PoolFence(q.control, 1, 2, 1)


def _blocks(fn) -> tuple:
    """Run ``fn`` in a thread: (thread, event set when it returned)."""
    done = threading.Event()
    t = threading.Thread(target=lambda: (fn(), done.set()), daemon=True)
    t.start()
    return t, done


def test_a_reader_waits_until_rank_0_wrote_the_layer():
    (p0, f0), (p1, f1) = _pair()
    f0.begin_step()
    f1.begin_step()
    t, done = _blocks(lambda: f1.wait_layer(1))
    assert not done.wait(0.1)
    f0.layer_written(0)  # another layer does not release it
    assert not done.wait(0.05)
    f0.layer_written(1)
    assert done.wait(5.0)
    f1.wait_layer(1)  # already written: returns at once
    t.join()
    with pytest.raises(ValueError, match="outside 0..2"):
        f1.wait_layer(3)
    p0.release(), p1.release()


def test_rank_0_waits_until_every_reader_finished_the_last_step():
    (p0, f0), (p1, f1) = _pair()
    f0.begin_step(), f1.begin_step()  # step 1: nobody has to wait
    for layer in range(LAYERS):
        f0.layer_written(layer)
        f1.wait_layer(layer)
    f0.end_step()  # the writer's end is no signal
    t, done = _blocks(f0.begin_step)  # step 2 would overwrite rows rank 1 may still read
    assert not done.wait(0.1)
    f1.end_step()
    assert done.wait(5.0)
    t.join()
    p0.release(), p1.release()


def test_a_dead_peer_or_a_stall_fails_the_waiter_with_one_line():
    (p0, f0), (p1, f1) = _pair()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    f0._set(f0._pids + 0, dead.pid)  # as if rank 0 had exited
    f1.begin_step()
    with pytest.raises(FenceError, match=r"rank 1 waited for rank 0 \(pid \d+\), which is gone"):
        f1.wait_layer(0)
    f0._set(f0._pids + 0, os.getpid())
    f1.timeout = 0.1
    with pytest.raises(FenceError, match="is that rank stalled"):
        f1.wait_layer(0)
    p0.release(), p1.release()


STEPS = 120


def _reader(info, layers, q, timeout):
    """Rank 1 in its own process: every row it reads must be this step's, and stay so until
    it says the step is done."""
    try:
        pool = SharedHostPool.attach(info, what=WHAT)
        fence = PoolFence(pool.control, 1, 2, layers, timeout=timeout)
        q.put("attached")
        for step in range(1, STEPS + 1):
            fence.begin_step()
            for layer in range(layers):
                fence.wait_layer(layer)
                row = pool.raw[layer * 4096 : (layer + 1) * 4096]
                want = (step * layers + layer) % 251
                assert bool((row == want).all()), f"step {step} layer {layer}: early or stale row"
            if step % 7 == 0:
                time.sleep(0.002)  # a slow reader: rank 0 must not overwrite meanwhile
            for layer in range(layers):
                row = pool.raw[layer * 4096 : (layer + 1) * 4096]
                want = (step * layers + layer) % 251
                assert bool((row == want).all()), f"step {step} layer {layer}: overwritten early"
            fence.end_step()
        pool.release()
        q.put("ok")
    except BaseException as e:  # noqa: B036 - reported to the parent
        q.put(f"{type(e).__name__}: {e}")


@needs_x86
def test_a_second_process_reads_every_row_of_its_step_and_only_those():
    """Rank 0 here, rank 1 in a spawned process; 120 steps of 3 layers rewrite the same rows
    (as reused blocks do)."""
    ctx = mp.get_context("spawn")
    pool = SharedHostPool.create(LAYERS * 4096, control_bytes(2, LAYERS), what=WHAT)
    fence = PoolFence(pool.control, 0, 2, LAYERS, timeout=child_timeout(6))
    q = ctx.Queue()
    child = ctx.Process(target=_reader, args=(pool.info, LAYERS, q, child_timeout(3)))
    child.start()
    try:
        assert q.get(timeout=child_timeout(12)) == "attached"
        pool.close_fd()
        for step in range(1, STEPS + 1):
            fence.begin_step()
            for layer in range(LAYERS):
                pool.raw[layer * 4096 : (layer + 1) * 4096] = (step * LAYERS + layer) % 251
                fence.layer_written(layer)
        assert q.get(timeout=child_timeout(6)) == "ok"
    finally:
        child.join(child_timeout(3))
        if child.is_alive():
            child.kill()
        pool.release()
    assert child.exitcode == 0
