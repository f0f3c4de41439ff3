"""Start and stop `vllm serve` for a config (or any command with the same interface)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from typing import List, Optional

from evals.gsm8k.config import EvalConfig

DEFAULT_SERVE_CMD = "vllm serve"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def visible_gpu_count() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES if set, else `nvidia-smi -L`, else 0."""
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([d for d in cvd.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def serve_argv(cfg: EvalConfig, port: int, serve_cmd: str = DEFAULT_SERVE_CMD) -> List[str]:
    return [
        *shlex.split(serve_cmd),
        cfg.model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *cfg.server_argv(),
    ]


class ServerProcess:
    """`vllm serve` in its own process group, output to a log file; a context manager."""

    def __init__(
        self, cfg: EvalConfig, port: int, log_path: str, serve_cmd: str = DEFAULT_SERVE_CMD
    ):
        self.argv = serve_argv(cfg, port, serve_cmd)
        self.env = {**os.environ, **cfg.env}
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self._log = None

    def start(self) -> "ServerProcess":
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        self._log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as e:
            self._log.close()
            raise RuntimeError(f"cannot start {self.argv[0]!r}: {e}") from None
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n_bytes))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + grace_s
            while self.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
