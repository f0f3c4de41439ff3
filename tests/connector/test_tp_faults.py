"""A TP rank sharing the host pool whose wait for another fails (the other died or stalled past
``tp_wait_timeout_s``): one line naming that rank, then the rank leaves its group (exits), since
raising would leave vLLM waiting for rank 0's reply. The vLLM stage checks the served path
(tests/vllm_conformance/test_vllm_tp_faults.py)."""

from __future__ import annotations

import pytest

from hisparse.connector import tp_pool
from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.runtime.pool_fence import PoolFence, arch_shares_pool, control_bytes
from hisparse.runtime.shared_pool import SharedHostPool
from hisparse.vllm.settings import config_from_extra

pytestmark = pytest.mark.skipif(not arch_shares_pool(), reason="shared on x86-64 only")


class _Left(Exception):
    pass


def _steps(timeout: float) -> tuple:
    p0 = SharedHostPool.create(1 << 20, control_bytes(2, 2), what="pool")
    p1 = SharedHostPool.attach(p0.info, what="pool")
    f0 = PoolFence(p0.control, 0, 2, 2, timeout)
    f1 = PoolFence(p1.control, 1, 2, 2, timeout)
    p0.close_fd()
    return (p0, tp_pool.SharedSteps(f0, ["a", "b"])), (p1, tp_pool.SharedSteps(f1, ["a", "b"]))


def test_a_stalled_writer_makes_the_reader_name_it_and_leave(monkeypatch, caplog):
    caplog.set_level("ERROR", logger="vllm.hisparse")
    codes = []

    def _exit(code):
        codes.append(code)
        raise _Left

    monkeypatch.setattr(tp_pool.os, "_exit", _exit)
    (p0, s0), (p1, s1) = _steps(timeout=0.2)
    s0.start(), s1.start()
    with pytest.raises(_Left):  # rank 0 never writes layer "b"
        s1.save("b", lambda: None)
    assert codes == [tp_pool.FENCE_EXIT]
    line = caplog.records[-1].getMessage()
    assert "TP rank 1 waited for rank 0" in line and "is that rank stalled?" in line
    assert "leaving the TP group" in line and "\n" not in line
    p0.release(), p1.release()


def test_the_wait_timeout_is_a_checked_setting():
    assert HiSparseConfig().tp_wait_timeout_s < 300  # before vLLM's own execute-model timeout
    assert HiSparseConfig(tp_wait_timeout_s=3).tp_wait_timeout_s == 3.0
    for bad in (0, -1, True, "5", float("nan"), 1e9):
        with pytest.raises(HiSparseConfigError, match=r"\['tp_wait_timeout_s'\]"):
            config_from_extra({"tp_wait_timeout_s": bad})
