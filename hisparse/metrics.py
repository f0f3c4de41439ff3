"""Standalone Prometheus exporter for servers without vLLM's metrics stack.

It owns a private ``CollectorRegistry``, registers the HiSparse metrics through the very same
``HiSparsePromMetrics`` vLLM uses (``HiSparseConnector.build_prom_metrics``), and serves the text
exposition format over HTTP::

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
from types import SimpleNamespace
from typing import Any, Optional, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import start_http_server

from hisparse.stats import HiSparsePromMetrics


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
            cls: functools.partial(cls, registry=self.registry) for cls in (Gauge, Counter, Histogram)
        }
        labelnames = ["model_name", "engine"]
        per_engine = {int(i): [model_name, str(int(i))] for i in engine_indexes}
        # vLLM's base reads vllm_config.kv_transfer_config; a bare namespace satisfies it.
        self.prom = HiSparsePromMetrics(
            SimpleNamespace(kv_transfer_config=None), metric_types, labelnames, per_engine
        )
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
