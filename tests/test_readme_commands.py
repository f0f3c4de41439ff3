"""The README's two commands are the promise users meet first: (b) is what CI runs, verbatim,
and (a) installs the same way and runs the main job."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    return re.findall(r"```bash\n(.+?)\n```", text.split("## Results")[0])


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
