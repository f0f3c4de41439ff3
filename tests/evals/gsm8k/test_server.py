"""evals/gsm8k/server.py: the `vllm serve` process the harness starts (the fake server stands in
for it as a child process): server args passed, readiness awaited, the process group stopped, a
crash, a startup timeout and a missing binary reported. The started processes are recorded
(`started_servers`) so the tests check what happened to them, not how long it took."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from evals.gsm8k import server as server_mod
from evals.gsm8k.harness import run_config
from tests.evals.gsm8k.builders import (
    FAKE_SERVER,
    canned_answers,
    make_cfg,
    make_dataset,
    write_data,
)

pytestmark = pytest.mark.subprocess

SERVE_CMD = f"{sys.executable} {FAKE_SERVER}"


@pytest.fixture
def started_servers(monkeypatch):
    """Every ServerProcess the harness starts, in order (the harness builds them itself)."""
    started = []

    class Recorded(server_mod.ServerProcess):
        def start(self):
            started.append(self)
            return super().start()

    monkeypatch.setattr(server_mod, "ServerProcess", Recorded)
    return started


def _group_is_gone(pgid: int) -> bool:
    """No process is left in the process group (the server runs in a session of its own)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_harness_starts_and_stops_the_server(tmp_path, started_servers):
    """The launch path of the nightly, with the fake server standing in for `vllm serve`:
    the config's server args are passed, readiness is awaited, the process group is stopped."""
    test, train = make_dataset(8, 2)
    data = write_data(tmp_path, test, train)
    ans = tmp_path / "answers.json"
    ans.write_text(json.dumps(canned_answers(test, 8)))
    cfg = make_cfg(
        num_questions=8,
        num_fewshot=2,
        accuracy_threshold=1.0,
        server_args=f"--ready-after 1.0 --answers {ans} --enforce-eager "
        '--kv-transfer-config \'{"kv_connector":"HiSparseConnector"}\'',
    )
    res = run_config(
        cfg,
        serve_cmd=SERVE_CMD,
        log_dir=str(tmp_path / "logs"),
        check_gpus=False,
        data_dir=data,
        quiet=True,
    )
    assert res.error is None, res.error
    assert res.passed and res.correct == 8 and res.startup_s >= 0.9
    log = (tmp_path / "logs" / "fake.server.log").read_text()
    assert "fake server for fake/model" in log
    # exactly one server, started with the config's args, and stopped by the harness: ended by
    # its SIGTERM (not the SIGKILL after the grace period), its whole process group gone
    [srv] = started_servers
    assert str(ans) in srv.argv and "--enforce-eager" in srv.argv
    assert srv.proc.returncode == -signal.SIGTERM
    assert not srv.alive() and _group_is_gone(srv.proc.pid)


def test_server_crash_and_startup_timeout_fail_fast(tmp_path, started_servers):
    test, train = make_dataset(2, 0)
    data = write_data(tmp_path, test, train)
    crash = make_cfg(
        num_questions=2,
        num_fewshot=0,
        startup_max_wait_seconds=60,
        server_args="--ready-after 100 --exit-after 0.5",
    )
    res = run_config(
        crash,
        serve_cmd=SERVE_CMD,
        log_dir=str(tmp_path / "l1"),
        check_gpus=False,
        data_dir=data,
        quiet=True,
    )
    # the crash is reported as such, not after the 60 s startup wait ("not ready after 60 s"):
    # the server ended on its own with the fake crash's status 3, the harness did not stop it
    assert not res.passed and "exited during startup" in res.error
    assert "not ready after" not in res.error
    [crashed] = started_servers
    assert crashed.proc.returncode == 3 and _group_is_gone(crashed.proc.pid)
    slow = make_cfg(
        num_questions=2, num_fewshot=0, startup_max_wait_seconds=1, server_args="--ready-after 100"
    )
    res = run_config(
        slow,
        serve_cmd=SERVE_CMD,
        log_dir=str(tmp_path / "l2"),
        check_gpus=False,
        data_dir=data,
        quiet=True,
    )
    assert not res.passed and "not ready after 1 s" in res.error and "log tail" in res.error
    timed_out = started_servers[1]
    assert timed_out.proc.returncode == -signal.SIGTERM and _group_is_gone(timed_out.proc.pid)
    missing = run_config(
        crash,
        serve_cmd="/nonexistent/vllm serve",
        log_dir=str(tmp_path / "l3"),
        check_gpus=False,
        data_dir=data,
        quiet=True,
    )
    assert not missing.passed and "cannot start" in missing.error
    assert started_servers[2].proc is None  # nothing was started
