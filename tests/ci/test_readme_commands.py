"""The README's two commands are the promise users meet first: (b) is what CI runs, verbatim,
and (a) installs the same way and runs the main job."""

from __future__ import annotations

import os
import re

from tests import REPO_ROOT

ROOT = str(REPO_ROOT)


def _readme():
    return open(os.path.join(ROOT, "README.md")).read()


def _section(title):
    text = _readme()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _readme_commands():
    return re.findall(r"```bash\n(.+?)\n```", _section("Two commands"))


def test_readme_leads_with_two_commands():
    cmds = _readme_commands()
    assert len(cmds) == 2
    install, test = cmds
    assert install.endswith("&& hisparse demo")
    assert test.endswith("&& python -m pytest -q")
    prefix = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0"
    assert install.startswith(prefix) and test.startswith(prefix)


def test_ci_runs_the_readme_test_command_verbatim():
    _, test = _readme_commands()
    ci = open(os.path.join(ROOT, ".ci", "run")).read().splitlines()
    assert test in ci


def test_installing_names_the_cpu_index_with_the_same_pin():
    """A stock machine gets the CUDA build from PyPI for a bare pin: the README says where the
    CPU build is, for the very version the two commands pin."""
    install, _ = _readme_commands()
    pin = re.search(r"torch==([0-9.]+)", install).group(1)
    text = _section("Installing")
    assert f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu" in text
    assert f"{pin}+cpu" in text
    # Next to a CUDA torch: build against it, never pin another torch there.
    cuda_part = text[text.index("Next to a CUDA build") : text.index("**Extras.**")]
    assert "--no-build-isolation" in cuda_part and "torch==" not in cuda_part


def test_installing_explains_the_silent_compile_step():
    text = _section("Installing")
    assert "120–170 s" in text and "-v" in text and "build/temp-" in text


def test_time_figures_are_measured_ranges_with_what_they_depend_on():
    """Issue 23, item 9: single figures ("about 20 s") matched neither an idle nor a loaded
    machine; each time is an idle figure and a loaded range, and says what it follows."""
    text = _readme()
    for stale in ("about 20 s", "about 10\ns", "about 10 s", "40–130 s"):
        assert stale not in text, stale
    demo = _section("Two commands")
    assert "17 s when idle" in demo and "35–115 s" in demo and "free cores" in demo
    build = _section("Installing")
    assert "13 s" in build and "120–170 s" in build and "MAX_JOBS" in build
    assert "3 s idle and 10–50 s loaded" in build
