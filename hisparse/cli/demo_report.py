"""What `hisparse demo` reports: each run's figures from its ``Generation`` (hisparse.engine.dsa
.generate), the token parity across runs, the side-by-side table, the digest of the generated
tokens, and the counters scraped back from its Prometheus endpoint. Imports no torch."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.request
from typing import Dict, List

# Counter data keys -> Prometheus series as exposed (counters get `_total`).
COUNTER_SERIES = {
    "hits": "vllm:hisparse_cache_hits_total",
    "misses": "vllm:hisparse_cache_misses_total",
    "host_to_device_bytes": "vllm:hisparse_host_to_device_bytes_total",
}
# Hybrid residency's moves, the demo's hybrid run's (rows per layer, as the engine counts them).
SPILL_SERIES = {
    k: f"vllm:hisparse_{k}_total"
    for k in ("spilled_requests", "spilled_rows", "spilled_bytes", "returned_requests",
              "returned_rows")
}  # fmt: skip


def spill_counters(counters: dict, row_bytes: int) -> dict:
    """A hybrid run's moves (``HybridRows.close``'s counters) as the spill series count them."""
    return dict(
        spilled_requests=counters.get("spilled_requests", 0),
        spilled_rows=counters.get("spilled_rows", 0),
        spilled_bytes=counters.get("spilled_rows", 0) * row_bytes,
        returned_requests=counters.get("returns", 0),
        returned_rows=counters.get("returned_rows", 0),
    )


def tokens_digest(tokens) -> str:
    """SHA-256 of the generated tokens (request order): compare runs across machines/devices."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(json.dumps(t).encode())
        h.update(b";")
    return h.hexdigest()


def scrape_counters(port: int, host: str = "127.0.0.1", series_of: dict = COUNTER_SERIES) -> dict:
    """GET /metrics and return the counters of ``series_of`` (default the three lookup
    counters; ``SPILL_SERIES``), each summed over label sets."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for key, series in series_of.items():
        total = 0.0
        for m in re.finditer(rf"^{re.escape(series)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M):
            total += float(m.group(1))
        out[key] = int(total)
    return out


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} TiB"


def run_stats(g) -> dict:
    """A run's figures: tokens and time, the connector's counters (none for resident), the
    device bytes it held (``Generation.device_bytes``)."""
    c = dict(g.counters)
    hits, misses = c.get("hits", 0), c.get("misses", 0)
    tokens = sum(len(t) for t in g.tokens)
    return dict(
        requests=len(g.tokens),
        generated_tokens=tokens,
        wall_s=g.seconds,
        tokens_per_s=tokens / g.seconds if g.seconds > 0 else 0.0,
        hits=hits,
        misses=misses,
        hit_rate=hits / (hits + misses) if hits + misses else 0.0,
        host_to_device_bytes=c.get("host_to_device_bytes", 0),
        device_kv_bytes=g.device_bytes.get("rows", 0),
        index_key_bytes=g.device_bytes.get("index_keys", 0),
        counters=c,
    )


def parity(tokens: Dict[str, List[List[int]]]) -> dict:
    """Whether every run generated the same tokens for every request; the first difference."""
    modes = list(tokens)
    ref = tokens[modes[0]]
    bad = [i for i in range(len(ref)) if any(tokens[m][i] != ref[i] for m in modes[1:])]
    detail = f"tokens identical in {len(ref)}/{len(ref)} requests ({', '.join(modes)})"
    if bad:
        i, m = bad[0], next(m for m in modes[1:] if tokens[m][bad[0]] != ref[bad[0]])
        at = next((j for j, (a, b) in enumerate(zip(ref[i], tokens[m][i])) if a != b), None)
        detail = (
            f"tokens differ in {len(bad)}/{len(ref)} requests; request {i}: {modes[0]} and {m} "
            f"part at token {at if at is not None else min(len(ref[i]), len(tokens[m][i]))}"
        )
    return dict(
        ok=not bad, tokens_equal=len(ref) - len(bad), mismatched_requests=bad, detail=detail
    )


def _cell(s: dict, key: str) -> str:
    v = s[key]
    if key == "wall_s":
        return f"{v:.1f} s"
    if key == "tokens_per_s":
        return f"{v:.1f}"
    if not s["counters"] and key in ("hit_rate", "hits", "misses", "host_to_device_bytes"):
        return "-"  # resident: no hot buffers
    if key == "hit_rate":
        return f"{100 * v:.1f} %"
    return fmt_bytes(v) if key.endswith("bytes") else str(v)


ROWS = (
    ("requests", "requests"),
    ("generated tokens", "generated_tokens"),
    ("wall time", "wall_s"),
    ("tokens/s", "tokens_per_s"),
    ("hit rate", "hit_rate"),
    ("hits", "hits"),
    ("misses", "misses"),
    ("host->device bytes", "host_to_device_bytes"),
    ("device KV rows", "device_kv_bytes"),
    ("device index keys", "index_key_bytes"),
)


def summary_table(summary: dict) -> str:
    modes = [m for m in ("resident", "hisparse", "hybrid") if m in summary]
    rows = [(label, *(_cell(summary[m], key) for m in modes)) for label, key in ROWS]
    if "hybrid" in summary:
        c = summary["hybrid"]["counters"]
        spills = f"{c.get('spilled_requests', 0)} / {c.get('returns', 0)}"
        rows.append(("spilled requests / returns", *(["-"] * (len(modes) - 1)), spills))
    w0 = max(len(r[0]) for r in rows + [("parity (generated tokens)",)])
    ws = [max(len(m), *(len(r[i + 1]) for r in rows)) for i, m in enumerate(modes)]
    lines = [
        "  ".join([" " * w0] + [f"{m:>{w}}" for m, w in zip(modes, ws)]),
        "  ".join(["-" * w0] + ["-" * w for w in ws]),
    ]
    lines += ["  ".join([f"{r[0]:<{w0}}"] + [f"{c:>{w}}" for c, w in zip(r[1:], ws)]) for r in rows]
    par = summary["parity"]
    verdict = ("OK: " if par["ok"] else "FAILED: ") + par["detail"]
    lines.append(f"{'parity (generated tokens)':<{w0}}  {verdict}")
    if "metrics_endpoint" in summary:
        me = summary["metrics_endpoint"]
        ok = "counters match" if me["matches"] else "counters DIFFER"
        lines.append(f"{'metrics endpoint port ' + str(me['port']):<{w0}}  {ok}")
    return "\n".join(lines)
