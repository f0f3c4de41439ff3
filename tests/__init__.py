"""The test suite, one folder per package module (ops, binding, runtime, connector, engine, cli,
evals) plus ci/ for the repository itself; shared builders sit here (helpers, oracle, ...)."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
