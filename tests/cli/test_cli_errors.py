"""Commands end in one line, never a traceback: resources checked before allocating, Ctrl-C,
unwritable outputs, a source tree without the extension, a busy port; each line names its
command."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from hisparse.cli import app as cli
from hisparse.cli import demo
from hisparse.cli.errors import CommandError
from hisparse.engine import EngineConfig
from tests import REPO_ROOT
from tests.engine_helpers import SMALL_FLAGS
from tests.helpers import child_timeout

ROOT = str(REPO_ROOT)


def _one_error_line(capsys, prefix):
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    assert "Traceback" not in err
    return lines[0]


def test_resident_run_too_big_is_refused_before_allocating(capsys, monkeypatch):
    def no_run(*a, **k):
        raise AssertionError("the workload must not start")

    monkeypatch.setattr(demo, "run_workload", no_run)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--prompt-len", "1048576", "--concurrency", "64", "--no-progress"])
    assert e.value.code == 2
    line = _one_error_line(capsys, "hisparse demo: error: the resident run needs")
    assert "--prompt-len" in line and "--concurrency" in line


def test_memory_budget_covers_both_runs_and_devices():
    cfg = EngineConfig(
        num_layers=2,
        top_k=16,
        hot_size=32,
        max_running=4,
        prompt_len=1000,
        output_len=24,
        recent_window=4,
    )
    need = demo.memory_needs(cfg)
    rows = 4 * 1024  # max context 1024 rows per state row
    assert need["resident_device"] == rows * 2 * cfg.row_bytes
    assert need["hisparse_device"] == 4 * (4 + 32) * 2 * cfg.row_bytes
    assert need["hisparse_host"] == (rows + cfg.block_size) * 2 * cfg.row_bytes
    assert demo.check_memory(cfg, "cpu", host_free=10 * need["resident_device"]) == need
    with pytest.raises(CommandError, match="the HiSparse run needs .* of host memory"):
        demo.check_memory(cfg, "cpu", host_free=need["resident_device"])
    # On a GPU the small HiSparse device footprint fits where the resident KV does not.
    with pytest.raises(CommandError, match="the resident run needs .* of device memory"):
        demo.check_memory(cfg, "cuda", host_free=1 << 40, device_free=need["resident_device"] - 1)
    with pytest.raises(CommandError, match="the HiSparse run needs .* of host memory"):
        demo.check_memory(cfg, "cuda", host_free=1000, device_free=1 << 40)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["demo", "--layers", "4", "--index-share", "8"], "--index-share"),
        (["bench", "--layers", "2", "--index-share", "3"], "--index-share"),
        (["demo", "--json", "/proc/hisparse-out.json"], "--json"),
        (["bench", "--json", "/proc/hisparse-out.json"], "--json"),
        (["plan", "--preset", "glm-5.x", "--json", "/proc/hisparse-out.json"], "--json"),
        (["demo", "--bogus"], "--bogus"),
        (["plan", "--preset", "glm-5.x", "--bogus"], "--bogus"),
    ],
)
def test_bad_value_is_named_by_its_subcommand(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert flag in _one_error_line(capsys, f"hisparse {argv[0]}: error:")


def test_unwritable_output_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    ran = []
    monkeypatch.setattr(demo, "run_workload", lambda *a, **k: ran.append(1))
    target = ro / "out.json"
    try:
        if os.access(ro, os.W_OK):
            # root writes anywhere a mode bit forbids; a read-only filesystem still refuses.
            target = "/proc/hisparse-out/out.json"
        with pytest.raises(SystemExit) as e:
            cli.main(["demo", "--json", str(target)])
    finally:
        ro.chmod(0o700)
    assert e.value.code == 2 and not ran
    _one_error_line(capsys, "hisparse demo: error: argument --json: cannot write")


def test_busy_metrics_port_exits_2_with_one_line(capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        with pytest.raises(SystemExit) as e:
            cli.main(
                ["demo", *SMALL_FLAGS, "--no-progress", "--metrics-port", str(s.getsockname()[1])]
            )
    finally:
        s.close()
    assert e.value.code == 2
    assert "--metrics-port" in _one_error_line(
        capsys, "hisparse demo: error: argument --metrics-port"
    )


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_workload", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *SMALL_FLAGS, "--no-progress"])
    assert e.value.code == 130
    _one_error_line(capsys, "hisparse demo: interrupted")


def test_unexpected_failure_is_one_line_naming_the_command(capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate"
            "\nException raised from allocate at alloc_cpu.cpp:117"
        )

    monkeypatch.setattr(demo, "run_workload", boom)
    monkeypatch.delenv("HISPARSE_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *SMALL_FLAGS, "--no-progress"])
    assert e.value.code == 1
    line = _one_error_line(capsys, "hisparse demo: error: RuntimeError: [enforce fail")
    assert "HISPARSE_TRACEBACK=1" in line


def test_real_sigint_during_a_run_leaves_no_traceback():
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hisparse",
            "demo",
            "--no-progress",
            "--requests",
            "200",
            "--prompt-len",
            "2048",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = p.stdout.readline()
        assert first.startswith("workload:"), first
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=child_timeout(6))
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and err.strip() == "hisparse demo: interrupted"


def test_source_tree_without_the_extension_is_one_line(tmp_path):
    """A fresh clone run with `python -m hisparse` before building: no hisparse._C."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'hisparse._C': raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from hisparse import cli\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    for cmd in (["demo", *SMALL_FLAGS], ["bench", "--skip-ops"]):
        p = subprocess.run(
            [sys.executable, "-c", code, *cmd],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=child_timeout(12),
        )
        assert p.returncode == 1, p.stderr
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1, p.stderr
        assert lines[0].startswith(f"hisparse {cmd[0]}: error: hisparse._C is not built")
        assert "pip install --no-build-isolation" in lines[0]


def test_plot_without_matplotlib_is_one_line_before_the_sweep(tmp_path):
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'matplotlib': raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import hisparse.cli.bench as b\n"
        "b.hot_size_sweep = lambda *a, **k: sys.exit('the sweep must not run')\n"
        "from hisparse import cli\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, "bench", "--skip-ops", "--plot", str(tmp_path / "p.png")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=child_timeout(12),
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip() == (
        "hisparse bench: error: argument --plot: needs matplotlib, which is "
        "not installed (pip install 'hisparse[plot]')"
    )


def test_python_m_hisparse_metrics_serves_until_interrupted():
    p = subprocess.Popen(
        [sys.executable, "-m", "hisparse.connector.exporter", "--port", "0", "--model-name", "m1"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline()
        assert line.startswith("serving HiSparse metrics on http://127.0.0.1:"), line
        url = line.split()[4]
        text = urllib.request.urlopen(url, timeout=child_timeout(1)).read().decode()
        for series in (
            "vllm:hisparse_cache_hits_total",
            "vllm:hisparse_cache_misses_total",
            "vllm:hisparse_host_to_device_bytes_total",
            "vllm:hisparse_host_pool_usage",
            "vllm:hisparse_hot_rows_in_use",
        ):
            assert f'{series}{{engine="0",model_name="m1"}}' in text, series
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=child_timeout(3))
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "Traceback" not in err


def test_python_m_hisparse_metrics_busy_port_exits_2():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "hisparse.connector.exporter",
                "--port",
                str(s.getsockname()[1]),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=child_timeout(6),
        )
    finally:
        s.close()
    assert p.returncode == 2
    assert p.stderr.startswith(
        "python -m hisparse.connector.exporter: error: argument --port: cannot serve"
    )
    assert len(p.stderr.strip().splitlines()) == 1
