"""TP ranks sharing one pinned host pool on CUDA (``device_fence``): two processes on one GPU,
rank 0 writing each step's rows and rank 1 gathering them, both replaying a captured step;
every byte rank 1 reads is the step's, and without its waits it is not (the control). A rank
killed, or stopped, makes the other leave with one line naming it (exit 70)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.devices import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]
ROOT = Path(__file__).resolve().parents[2]


def _start(rank: int, where: Path, mode: str, steps: int = 60, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.runtime.fence_ranks",
            str(rank),
            str(where),
            mode,
            str(steps),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def _pair(tmp_path: Path, mode: str, **env) -> tuple:
    return _start(0, tmp_path, mode, **env), _start(1, tmp_path, mode, **env)


def _finish(p: subprocess.Popen, timeout: float = 120) -> tuple:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    return p.returncode, out, err


def test_rank_1_reads_every_byte_rank_0_wrote_this_step_under_replay(tmp_path):
    w, r = _pair(tmp_path, "graph")
    (cw, ow, ew), (cr, orr, er) = _finish(w), _finish(r)
    assert cw == 0 and cr == 0, (ew[-2000:], er[-2000:])
    assert "steps: 62" in ow and "steps: 62" in orr  # 2 eager + 60 replays on both ranks
    assert "mismatched bytes: 0" in orr


def test_without_the_waits_rank_1_reads_rows_of_other_steps(tmp_path):
    w, r = _pair(tmp_path, "nofence")
    (cw, _, ew), (cr, orr, er) = _finish(w), _finish(r)
    assert cw == 0 and cr == 0, (ew[-2000:], er[-2000:])
    bad = int(re.search(r"mismatched bytes: (\d+)", orr).group(1))
    assert bad > 0  # the control: the test above can fail


def _replaying(p: subprocess.Popen, limit: float = 90.0) -> None:
    start = time.monotonic()
    line = p.stdout.readline()
    assert "replaying" in line, (line, time.monotonic() - start)


def test_a_killed_reader_fails_the_writer_with_one_line(tmp_path):
    w, r = _pair(tmp_path, "loop")
    _replaying(w)
    _replaying(r)
    time.sleep(1.0)
    r.kill()
    r.wait()
    code, _, err = _finish(w, timeout=60)
    assert code == 70, err[-2000:]
    line = [x for x in err.splitlines() if "HiSparse shared host pool" in x]
    assert len(line) == 1, err[-2000:]
    assert f"rank 1 (pid {r.pid}) is gone" in line[0] and "TP rank 0 waited for rank 1" in line[0]


def test_a_stopped_writer_fails_the_reader_after_the_timeout(tmp_path):
    w, r = _pair(tmp_path, "loop", FENCE_TIMEOUT_S="3")
    _replaying(w)
    _replaying(r)
    time.sleep(1.0)
    os.kill(w.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        code, _, err = _finish(r, timeout=60)
        waited = time.monotonic() - start
    finally:
        os.kill(w.pid, signal.SIGKILL)
        w.wait()
    assert code == 70, err[-2000:]
    line = [x for x in err.splitlines() if "HiSparse shared host pool" in x]
    assert len(line) == 1, err[-2000:]
    assert "TP rank 1 waited for rank 0 for 3 s" in line[0] and "stalled?" in line[0]
    assert 2.5 < waited < 30
