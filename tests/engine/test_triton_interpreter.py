"""The DSA core's Triton kernels under Triton's interpreter on the CPU
(tests/engine/triton_interpreted.py says what that can and cannot check). Triton comes with the
test extra; without it this skips."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests import REPO_ROOT
from tests.helpers import child_timeout

#: The script's seconds on an idle machine (3-5 since it checks the core's kernels; 74 once).
IDLE_S = 8

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton (the test extra has it)"
)


def test_core_kernels_under_the_triton_interpreter():
    # A process of its own: the interpreter must be chosen before any kernel is defined.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    script = REPO_ROOT / "tests" / "engine" / "triton_interpreted.py"
    run = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=child_timeout(IDLE_S),
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.split() == [
        *("pages", "ok", "elementwise", "ok", "fp8_queries", "ok", "kernels", "ok", "misses", "ok"),
        *("attention", "ok", "step", "ok"),
    ]
