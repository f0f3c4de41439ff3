"""HiSparse telemetry containers on vLLM's KV-connector stats contract.

``HiSparseKVConnectorStats.data`` is a dict of plain lists (IPC-safe). Every entry of a counter
list is the delta of one snapshot; gauge lists hold one sample per snapshot. The classes follow
the contract of vLLM's ``KVConnectorStats`` / ``KVConnectorPromMetrics`` without importing vLLM;
``hisparse.vllm.connector`` derives vLLM's subclasses from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# (data key, Prometheus name, help). Prometheus exposes counters with a `_total` suffix.
COUNTERS = (
    (
        "hits",
        "vllm:hisparse_cache_hits",
        "HiSparse hot-buffer lookups answered by a row already in the hot buffer.",
    ),
    (
        "misses",
        "vllm:hisparse_cache_misses",
        "HiSparse hot-buffer lookups that copied the row in from the host pool.",
    ),
    (
        "host_to_device_bytes",
        "vllm:hisparse_host_to_device_bytes",
        "Bytes HiSparse gathers copied from the host pool into hot buffers (exact).",
    ),
)
# Hybrid residency (a host that keeps requests in device pages while they fit): whole requests
# move between the device KV pages and the host pool. Rows are counted per layer, like the
# gathers' bytes. The DSA engine's hybrid counts its moves in its run result, which `hisparse
# demo` reports through this container; a vLLM server never spills a request to the pool.
SPILL_COUNTERS = (
    (
        "spilled_requests",
        "vllm:hisparse_spilled_requests",
        "Requests whose KV rows were spilled from device pages to the HiSparse host pool.",
    ),
    (
        "spilled_rows",
        "vllm:hisparse_spilled_rows",
        "KV rows (per layer) copied from device pages to the host pool by spills.",
    ),
    (
        "spilled_bytes",
        "vllm:hisparse_spilled_bytes",
        "Bytes copied from device pages to the host pool by spills (exact).",
    ),
    (
        "returned_requests",
        "vllm:hisparse_returned_requests",
        "Spilled requests whose KV rows were brought back into device pages.",
    ),
    (
        "returned_rows",
        "vllm:hisparse_returned_rows",
        "KV rows (per layer) copied from the host pool back into device pages.",
    ),
)
GAUGES = (
    (
        "host_pool_usage",
        "vllm:hisparse_host_pool_usage",
        "Fraction (0-1) of HiSparse host-pool rows held by live requests, at the last snapshot.",
    ),
    (
        "hot_rows_in_use",
        "vllm:hisparse_hot_rows_in_use",
        "HiSparse hot-buffer rows holding a token, summed over layers, at the last snapshot.",
    ),
)
COUNTER_NAMES = tuple(name for _, name, _ in COUNTERS + SPILL_COUNTERS)
GAUGE_NAMES = tuple(name for _, name, _ in GAUGES)
#: Every metric name hisparse exports (the exported contract; see docs/telemetry.md).
METRIC_NAMES = COUNTER_NAMES + GAUGE_NAMES

_COUNTER_KEYS = tuple(k for k, _, _ in COUNTERS)
_SPILL_KEYS = tuple(k for k, _, _ in SPILL_COUNTERS)
_GAUGE_KEYS = tuple(k for k, _, _ in GAUGES)
_KEYS = _COUNTER_KEYS + _SPILL_KEYS + _GAUGE_KEYS


def _nonneg_int(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return v


@dataclass
class HiSparseKVConnectorStats:
    """Snapshot deltas of the hot-buffer counters (and gauge samples), one list entry each."""

    data: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        data = self.data if self.data is not None else {}
        if not isinstance(data, dict):
            raise ValueError(f"data must be a dict of lists, got {type(data).__name__}")
        clean = {}
        for key, values in data.items():
            if key not in _KEYS:
                raise ValueError(
                    f"data[{key!r}] is not a HiSparse stat (known: {', '.join(_KEYS)})"
                )
            if not isinstance(values, (list, tuple)):
                raise ValueError(f"data[{key!r}] must be a list, got {type(values).__name__}")
            clean[key] = list(values)
        for key in _KEYS:
            clean.setdefault(key, [])
        lens = {len(clean[k]) for k in _COUNTER_KEYS}
        if len(lens) != 1:
            raise ValueError(
                "data['hits'], data['misses'] and data['host_to_device_bytes'] must have equal "
                f"lengths, got {[len(clean[k]) for k in _COUNTER_KEYS]}"
            )
        # Spill deltas are recorded together (one snapshot = one entry in each), independently
        # of the hot-buffer counters: data from before spill counters existed has none.
        if len({len(clean[k]) for k in _SPILL_KEYS}) != 1:
            raise ValueError(
                f"the spill counters {', '.join(_SPILL_KEYS)} must have equal lengths, got "
                f"{[len(clean[k]) for k in _SPILL_KEYS]}"
            )
        self.data = clean

    def reset(self) -> None:
        self.data = {key: [] for key in _KEYS}

    def record_snapshot(
        self,
        hits: int,
        misses: int,
        host_to_device_bytes: int,
        *,
        host_pool_usage: Optional[float] = None,
        hot_rows_in_use: Optional[int] = None,
        spilled_requests: Optional[int] = None,
        spilled_rows: Optional[int] = None,
        spilled_bytes: Optional[int] = None,
        returned_requests: Optional[int] = None,
        returned_rows: Optional[int] = None,
    ) -> None:
        """Append one snapshot's deltas (and, if given, its gauge samples). The spill deltas are
        given all together or not at all."""
        spill = dict(
            spilled_requests=spilled_requests,
            spilled_rows=spilled_rows,
            spilled_bytes=spilled_bytes,
            returned_requests=returned_requests,
            returned_rows=returned_rows,
        )
        given = [k for k, v in spill.items() if v is not None]
        if given and len(given) != len(spill):
            missing = sorted(set(spill) - set(given))
            raise ValueError(f"spill counters are recorded together; missing {', '.join(missing)}")
        spill = {k: _nonneg_int(k, v) for k, v in spill.items()} if given else None
        self.data["hits"].append(_nonneg_int("hits", hits))
        self.data["misses"].append(_nonneg_int("misses", misses))
        self.data["host_to_device_bytes"].append(
            _nonneg_int("host_to_device_bytes", host_to_device_bytes)
        )
        if host_pool_usage is not None:
            u = float(host_pool_usage)
            if not 0.0 <= u <= 1.0:
                raise ValueError(
                    f"host_pool_usage must be a fraction in [0, 1], got {host_pool_usage!r}"
                )
            self.data["host_pool_usage"].append(u)
        if hot_rows_in_use is not None:
            self.data["hot_rows_in_use"].append(_nonneg_int("hot_rows_in_use", hot_rows_in_use))
        if spill is not None:
            for k, v in spill.items():
                self.data[k].append(v)

    def to_dict(self) -> dict:
        return self.data

    def aggregate(self, other: Any) -> "HiSparseKVConnectorStats":
        """Extend every list with ``other``'s entries (empty or None ``other`` is skipped)."""
        if other is None or other.is_empty():
            return self
        if not isinstance(other, HiSparseKVConnectorStats):
            other = HiSparseKVConnectorStats(data=other.data)
        for key in _KEYS:
            self.data[key].extend(other.data[key])
        return self

    def reduce(self) -> dict:
        """Sums over the interval (for vLLM's log line); gauges report their latest sample."""
        hits = sum(self.data["hits"])
        misses = sum(self.data["misses"])
        out: dict = {
            "HiSparse hot-buffer hits": hits,
            "HiSparse hot-buffer misses": misses,
            "HiSparse hit rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
            "HiSparse host-to-device bytes": sum(self.data["host_to_device_bytes"]),
        }
        if self.data["host_pool_usage"]:
            out["HiSparse host-pool usage"] = round(self.data["host_pool_usage"][-1], 4)
        if self.data["hot_rows_in_use"]:
            out["HiSparse hot rows in use"] = self.data["hot_rows_in_use"][-1]
        if self.data["spilled_requests"]:
            out["HiSparse spilled requests"] = sum(self.data["spilled_requests"])
            out["HiSparse spilled rows"] = sum(self.data["spilled_rows"])
            out["HiSparse spilled bytes"] = sum(self.data["spilled_bytes"])
            out["HiSparse returned requests"] = sum(self.data["returned_requests"])
            out["HiSparse returned rows"] = sum(self.data["returned_rows"])
        return out

    def is_empty(self) -> bool:
        return not any(self.data[key] for key in _KEYS)

    def totals(self) -> dict:
        """Counter sums keyed by data key (hits, misses, host_to_device_bytes)."""
        return {key: sum(self.data[key]) for key in _COUNTER_KEYS}

    def spill_totals(self) -> dict:
        """Spill counter sums keyed by data key (spilled_requests, ..., returned_rows)."""
        return {key: sum(self.data[key]) for key in _SPILL_KEYS}


class HiSparsePromMetrics:
    """Per-engine Prometheus counters and gauges; ``observe`` adds each snapshot delta once.

    ``metric_types`` maps prometheus_client's Gauge / Counter to the classes to instantiate (a
    registry bound, or vLLM's multiprocess-aware ones); ``per_engine_labelvalues`` maps each
    engine index to its label values."""

    def __init__(self, metric_types, labelnames, per_engine_labelvalues) -> None:
        from prometheus_client import Counter, Gauge

        self.per_engine_labelvalues = per_engine_labelvalues
        self.counters: dict = {}
        self.gauges: dict = {}
        for key, name, doc in COUNTERS + SPILL_COUNTERS:
            metric = metric_types[Counter](name=name, documentation=doc, labelnames=labelnames)
            self.counters[key] = self._per_engine(metric)
        for key, name, doc in GAUGES:
            metric = metric_types[Gauge](
                name=name, documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"
            )
            self.gauges[key] = self._per_engine(metric)

    def _per_engine(self, metric) -> dict:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Any, engine_idx: int = 0) -> None:
        if not isinstance(transfer_stats_data, dict):
            transfer_stats_data = getattr(transfer_stats_data, "data", transfer_stats_data)
        if not transfer_stats_data:
            return
        if engine_idx not in self.per_engine_labelvalues:
            raise KeyError(
                f"engine_idx {engine_idx} has no label values (known engines: "
                f"{sorted(self.per_engine_labelvalues)})"
            )
        for key in _COUNTER_KEYS + _SPILL_KEYS:
            child = self.counters[key][engine_idx]
            for delta in transfer_stats_data.get(key, ()):
                if delta:
                    child.inc(delta)
        for key in _GAUGE_KEYS:
            samples = transfer_stats_data.get(key, ())
            if samples:
                self.gauges[key][engine_idx].set(samples[-1])
