"""Commands end in one line, never a traceback: resources checked before allocating, Ctrl-C,
unwritable outputs, a source tree without the extension, a busy port; each line names its
command."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from hisparse.cli import app as cli
from hisparse.cli import demo, workload
from hisparse.cli.errors import CommandError
from hisparse.engine.dsa import generate as gen
from tests import REPO_ROOT
from tests.cli.small import DEMO_FLAGS
from tests.helpers import child_timeout


def _interruptible() -> None:
    """The child takes SIGINT even where this run ignores it (a shell's background job ignores
    it, and a Python started so never installs KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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

    monkeypatch.setattr(gen, "generate", no_run)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--prompt-len", "1048576", "--concurrency", "64", "--no-progress"])
    assert e.value.code == 2
    line = _one_error_line(capsys, "hisparse demo: error: the resident run needs")
    assert "--prompt-len" in line and "--concurrency" in line


def _plan(*argv):
    args = cli.build_parser().parse_args(["demo", *argv])
    return args, demo.plan(args)


def test_memory_needs_are_what_the_runs_hold(monkeypatch):
    """The budget the demo checks before a run is the device bytes the run then holds."""
    args, p = _plan(*DEMO_FLAGS)
    need = workload.memory_needs(p)
    held = {}
    real = gen.generate

    def spy(ck, mode, *a, **k):
        g = real(ck, mode, *a, **k)
        held[mode] = g.device_bytes["rows"] + g.device_bytes["index_keys"]
        return g

    monkeypatch.setattr(gen, "generate", spy)
    assert demo.run_demo(args, p, out=io.StringIO()).exit_code == 0
    assert held == {m: need[m] for m in ("resident", "hisparse", "hybrid")}
    assert held["hisparse"] < held["hybrid"] < held["resident"]


def test_memory_budget_covers_every_run_and_device():
    _, p = _plan(*DEMO_FLAGS)
    need = workload.memory_needs(p)
    pool = need["host_pool"]
    assert pool == (3 * 7 + 1) * 16 * 2 * 656  # every running request's rows, one block spare
    assert workload.check_memory(p, host_free=need["resident"] + pool) == need
    # on the CPU each run holds its device rows in RAM too, the host pool beside them
    with pytest.raises(CommandError, match="the hybrid run needs .* of host memory"):
        workload.check_memory(p, host_free=need["hybrid"] + pool - 1)
    p.device = "cuda"
    with pytest.raises(CommandError, match="the resident run needs .* of device memory"):
        workload.check_memory(p, host_free=1 << 40, device_free=need["resident"] - 1)
    with pytest.raises(CommandError, match="the hisparse run needs .* of host memory"):
        workload.check_memory(p, host_free=pool - 1, device_free=1 << 40)


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
    monkeypatch.setattr(gen, "generate", lambda *a, **k: ran.append(1))
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
            cli.main(["demo", *DEMO_FLAGS, "--metrics-port", str(s.getsockname()[1])])
    finally:
        s.close()
    assert e.value.code == 2
    assert "--metrics-port" in _one_error_line(
        capsys, "hisparse demo: error: argument --metrics-port"
    )


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "generate", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *DEMO_FLAGS])
    assert e.value.code == 130
    _one_error_line(capsys, "hisparse demo: interrupted")


def test_unexpected_failure_is_one_line_naming_the_command(capsys, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate"
            "\nException raised from allocate at alloc_cpu.cpp:117"
        )

    monkeypatch.setattr(gen, "generate", boom)
    monkeypatch.delenv("HISPARSE_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", *DEMO_FLAGS])
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
        preexec_fn=_interruptible,
    )
    try:
        first = p.stdout.readline(), p.stdout.readline()
        assert first[0].startswith("model:") and first[1].startswith("workload:"), first
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
    for cmd in (["demo", *DEMO_FLAGS], ["bench", "--skip-ops"]):
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
        preexec_fn=_interruptible,
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
