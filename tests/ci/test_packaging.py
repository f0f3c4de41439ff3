"""Packaging: the C++ standard follows the installed torch, editable rebuilds keep their objects,
and the runtime dependencies are only what `import hisparse` and the commands need."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys

import pytest
import setuptools
import torch

from tests import REPO_ROOT
from tests.cli.small import DEMO_FLAGS
from tests.helpers import child_timeout

ROOT = str(REPO_ROOT)
SETUP = os.path.join(ROOT, "setup.py")


@pytest.fixture(scope="module")
def setup_py():
    return runpy.run_path(SETUP, run_name="hisparse_setup_under_test")


@pytest.mark.parametrize(
    "version, std",
    [
        ("2.4.1", "c++17"),
        ("2.10.0", "c++17"),
        ("2.13.0+cpu", "c++17"),
        ("2.13.1", "c++17"),
        ("2.14.0", "c++20"),
        ("2.14.1+cu130", "c++20"),
        ("2.15.0", "c++20"),
        ("2.16.0a0+git1234", "c++20"),
        ("3.0.0", "c++20"),
    ],
)
def test_cxx_standard_follows_torch(setup_py, version, std):
    assert setup_py["cxx_standard"](version) == std


def test_unreadable_torch_version_is_refused(setup_py):
    with pytest.raises(ValueError, match="cannot read a torch version"):
        setup_py["cxx_standard"]("nightly")


@pytest.mark.parametrize(
    "value, want",
    [(None, "9.0"), ("", "9.0"), ("9.0", "9.0"), ("9.0a;10.0", "9.0a;10.0"),
     ("9.0 10.0+PTX", "9.0 10.0+PTX"), ("Hopper", "Hopper")],
)  # fmt: skip
def test_cuda_arch_list_defaults_to_hopper(setup_py, value, want):
    assert setup_py["cuda_arch_list"](value) == want


@pytest.mark.parametrize("value", ["8.0", "8.0;9.0", "8.6+PTX 9.0", "Ampere;9.0", "7.5"])
def test_an_architecture_without_clusters_is_refused_by_name(setup_py, value):
    arch = value.replace(";", " ").split()[0]
    with pytest.raises(ValueError, match=f"TORCH_CUDA_ARCH_LIST: {re.escape(arch)} is older"):
        setup_py["cuda_arch_list"](value)


@pytest.mark.parametrize("version, std", [("2.13.0", "c++17"), ("2.14.1", "c++20")])
def test_setup_passes_the_standard_to_the_compiler(monkeypatch, version, std):
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setenv("HISPARSE_NO_CUDA", "1")
    runpy.run_path(SETUP, run_name="__main__")
    (ext,) = captured["ext_modules"]
    assert f"-std={std}" in ext.extra_compile_args["cxx"]
    assert not any(
        f.startswith("-std=") and f != f"-std={std}" for f in ext.extra_compile_args["cxx"]
    )


def test_build_folder_persists_per_torch(setup_py):
    a = setup_py["build_temp_dir"]("2.13.0+cpu", False)
    b = setup_py["build_temp_dir"]("2.14.1+cu130", True)
    # Inside the repo's (ignored) build/, not a fresh temporary folder, so ninja can skip
    # objects whose sources did not change; one folder per torch so builds never mix.
    assert os.path.dirname(a) == os.path.join(ROOT, "build") == os.path.dirname(b)
    assert a != b and "2.13.0" in a and b.endswith("-cuda")
    build_ext = setup_py["_build_ext_class"](a, False)
    cmd = build_ext(setuptools.Distribution({"name": "x"}))
    cmd.finalize_options()
    assert cmd.build_temp == a


def _pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_runtime_dependencies_are_lean():
    p = _pyproject()
    names = {
        d.split(">")[0].split("=")[0].split("<")[0].strip().lower()
        for d in p["project"]["dependencies"]
    }
    # numpy: not called by hisparse, but torch warns "Failed to initialize NumPy" without it.
    assert names == {"torch", "numpy", "prometheus_client", "tqdm"}
    extras = p["project"]["optional-dependencies"]
    assert any(d.startswith("matplotlib") for d in extras["plot"])
    assert any(d.startswith("pyyaml") for d in extras["evals"])
    # README command (b) installs '.[test]': the tests need both.
    assert {"pyyaml", "matplotlib"} <= {d.split(">")[0] for d in extras["test"]}
    assert "ninja" in p["build-system"]["requires"]


def test_demo_needs_none_of_the_extras():
    """README command (a) installs no extra: the demo must run without matplotlib or pyyaml."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('matplotlib', 'yaml', 'ninja'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import hisparse.cli.bench, hisparse.cli.capacity, hisparse.connector.exporter\n"
        "from hisparse import cli\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "demo", *DEMO_FLAGS],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=child_timeout(30),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "parity (generated tokens)" in out.stdout
    assert "OK: tokens identical in 5/5 requests" in out.stdout
