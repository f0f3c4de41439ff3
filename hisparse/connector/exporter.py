"""Standalone Prometheus exporter for servers without vLLM's metrics stack.

It owns a private ``CollectorRegistry``, registers the HiSparse metrics through the very same
``HiSparsePromMetrics`` vLLM's stats logger uses (``build_prom_metrics``), and serves the
text exposition format over HTTP::

    exporter = HiSparseMetricsExporter()
    port = exporter.start(9400)          # 0 = any free port
    stats = worker.get_kv_connector_stats()
    if stats is not None:
        exporter.observe(stats)           # or exporter.observe(stats.data, engine_idx)
    exporter.stop()
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from hisparse.connector.stats import HiSparsePromMetrics


class HiSparseMetricsExporter:
    """HiSparse metrics on a private registry, optionally served on a port."""

    def __init__(
        self,
        *,
        engine_indexes: Sequence[int] = (0,),
        model_name: str = "hisparse",
        registry: Optional[CollectorRegistry] = None,
    ) -> None:
        if not engine_indexes:
            raise ValueError("engine_indexes must name at least one engine")
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        metric_types = {
            cls: functools.partial(cls, registry=self.registry)
            for cls in (Gauge, Counter, Histogram)
        }
        labelnames = ["model_name", "engine"]
        per_engine = {int(i): [model_name, str(int(i))] for i in engine_indexes}
        self.prom = HiSparsePromMetrics(metric_types, labelnames, per_engine)
        self._lock = threading.Lock()
        self._server = None
        self._thread = None
        self.port: Optional[int] = None

    def observe(self, stats: Any, engine_idx: int = 0) -> None:
        """Add one stats object's (or its ``data`` dict's) snapshot deltas; None is ignored."""
        if stats is None:
            return
        with self._lock:
            self.prom.observe(stats, engine_idx)

    def render(self) -> bytes:
        """The exposition text a scrape would return."""
        return generate_latest(self.registry)

    def start(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``addr:port`` in a daemon thread; returns the bound port."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535], got {port!r}")
        if self._server is not None:
            raise RuntimeError(f"the exporter is already serving on port {self.port}")
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as e:
            raise OSError(f"cannot serve HiSparse metrics on {addr}:{port}: {e}") from e
        self.port = self._server.server_port
        return self.port

    def stop(self) -> None:
        """Stop serving (safe to call when not started, and twice)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        self.port = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> "HiSparseMetricsExporter":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hisparse.connector.exporter``: serve the HiSparse series (zero until a server
    observes stats into them) so a Prometheus scrape config or the Grafana board can be wired up
    and checked before a real server runs."""
    import argparse
    import sys
    import time

    class _Parser(argparse.ArgumentParser):
        def error(self, message: str):  # one-line usage errors, exit status 2, as the CLI's
            self.exit(2, f"{self.prog}: error: {message}\n")

    parser = _Parser(
        prog="python -m hisparse.connector.exporter",
        description="Serve the HiSparse Prometheus metrics on /metrics until interrupted.",
    )
    parser.add_argument(
        "--port", type=int, default=9400, help="TCP port, 0 = any free port (default: 9400)"
    )
    parser.add_argument("--addr", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument(
        "--model-name", default="hisparse", help="model_name label (default: hisparse)"
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop after this many seconds (default: serve until Ctrl-C)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"argument --port: must be in [0, 65535], got {args.port}")
    if args.duration is not None and not args.duration > 0:
        parser.error(f"argument --duration: must be > 0, got {args.duration}")
    exporter = HiSparseMetricsExporter(model_name=args.model_name)
    try:
        port = exporter.start(args.port, addr=args.addr)
    except (OSError, ValueError) as e:
        parser.error(f"argument --port: {e}")
    print(
        f"serving HiSparse metrics on http://{args.addr}:{port}/metrics (Ctrl-C stops)", flush=True
    )
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        exporter.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
