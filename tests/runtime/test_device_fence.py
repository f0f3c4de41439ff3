"""The host side of the CUDA shared pool's flags (``device_fence``): what a failed GPU wait leaves
in the control block becomes one line naming the rank and the step, a dead peer makes every
rank's waits give up, and a rank not yet joined is not taken for a dead one. The kernels
themselves run in ``test_device_fence_cuda``."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from hisparse.runtime import device_fence, fence_kernels
from hisparse.runtime.device_fence import DeviceFence
from hisparse.runtime.pool_fence import PoolFence, control_bytes
from hisparse.runtime.shared_pool import SharedHostPool

pytestmark = pytest.mark.skipif(fence_kernels.triton is None, reason="needs Triton")
LAYERS = 3


@pytest.fixture
def ranks(monkeypatch):
    monkeypatch.setattr(device_fence, "_POLL_S", 0.01)
    monkeypatch.setattr(device_fence, "_PEERS_S", 0.02)
    pool = SharedHostPool.create(1 << 16, control_bytes(2, LAYERS), what="p")
    made = []

    def make(rank, fence=None):
        fence = fence or PoolFence(pool.control, rank, 2, LAYERS, timeout=7.0)
        faults = []
        got = threading.Event()

        def on_fault(msg):
            faults.append(msg)
            got.set()

        dev = DeviceFence(fence, pool.control_address, torch.device("cpu"), on_fault=on_fault)
        made.append(dev)
        return dev, faults, got

    yield pool, make
    for dev in made:
        dev.close()
    pool.release()


def _leave_status(dev: DeviceFence, code: int, step: int, what: int) -> None:
    """What ``fence_kernels.wait`` stores when it gives up: step and what, then the code."""
    flag = dev.fence.status_flag(dev.rank)
    dev.fence._set(flag + 1, step)
    dev.fence._set(flag + 2, what)
    dev.fence._set(flag, code)


def test_a_timed_out_wait_is_one_line_naming_the_rank_step_and_layer(ranks):
    pool, make = ranks
    make(0)
    dev, faults, got = make(1)
    dev.start()
    _leave_status(dev, fence_kernels.TIMED_OUT, 5, 1)
    assert got.wait(5)
    assert faults == [
        "HiSparse shared host pool: TP rank 1 waited for rank 0 for 7 s at step 5 (layer 1); "
        "is that rank stalled?"
    ]


def test_a_dead_peer_sets_abort_and_the_waiting_rank_names_it(ranks):
    pool, make = ranks
    w, faults, got = make(0)
    r = PoolFence(pool.control, 1, 2, LAYERS)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    r._set(r._pids + 1, dead.pid)  # rank 1's process is gone
    w.start()
    deadline = time.monotonic() + 5
    while not w.fence._get(w.fence.abort_flag) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert w.fence._get(w.fence.abort_flag) == (1 << 16) | 2  # gone, rank 1
    assert not faults  # nothing was waiting: no fault yet
    _leave_status(w, fence_kernels.ABORTED, 9, -2)  # its wait for rank 1's end of step
    assert got.wait(5)
    assert faults == [
        f"HiSparse shared host pool: TP rank 0 waited for rank 1 (pid {dead.pid}) at step 9 "
        f"(a step) and gave up: rank 1 (pid {dead.pid}) is gone"
    ]


def test_a_rank_not_yet_joined_is_not_taken_for_dead(ranks):
    pool, make = ranks
    w, faults, _ = make(0)
    w.start()
    time.sleep(0.2)
    assert w.fence.pid(1) == 0 and w.fence._get(w.fence.abort_flag) == 0 and not faults


def test_another_ranks_timeout_is_named_as_the_reason(ranks):
    pool, make = ranks
    w, _, _ = make(0)
    dev, faults, got = make(1)
    dev.start()
    dev.fence._set(dev.fence.abort_flag, (2 << 16) | 1)  # rank 0's wait timed out on rank 0?
    _leave_status(dev, fence_kernels.ABORTED, 4, 2)
    assert got.wait(5)
    assert faults[0].endswith(
        "at step 4 (layer 2) and gave up: rank 0 stopped responding (another rank's wait timed out)"
    )


def test_a_closed_fence_reports_nothing(ranks):
    pool, make = ranks
    make(0)
    dev, faults, got = make(1)
    dev.start()
    dev.close()
    dev.close()
    _leave_status(dev, fence_kernels.TIMED_OUT, 1, 0)
    assert not got.wait(0.2) and not faults
