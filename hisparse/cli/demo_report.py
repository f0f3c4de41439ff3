"""What `hisparse demo` reports: the side-by-side summary table, the digest of the generated
tokens, and the counters scraped back from its Prometheus endpoint."""

from __future__ import annotations

import hashlib
import json
import re
import urllib.request

# Counter data keys -> Prometheus series as exposed (counters get `_total`).
COUNTER_SERIES = {
    "hits": "vllm:hisparse_cache_hits_total",
    "misses": "vllm:hisparse_cache_misses_total",
    "host_to_device_bytes": "vllm:hisparse_host_to_device_bytes_total",
}


def tokens_digest(tokens) -> str:
    """SHA-256 of the generated tokens (request order): compare runs across machines/devices."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(json.dumps(t).encode())
        h.update(b";")
    return h.hexdigest()


def scrape_counters(port: int, host: str = "127.0.0.1") -> dict:
    """GET /metrics and return the three HiSparse counters (summed over label sets)."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for key, series in COUNTER_SERIES.items():
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


def summary_table(summary: dict) -> str:
    r, h = summary["resident"], summary["hisparse"]
    rows = [
        ("requests", r["requests"], h["requests"]),
        ("generated tokens", r["generated_tokens"], h["generated_tokens"]),
        ("wall time", f"{r['wall_s']:.1f} s", f"{h['wall_s']:.1f} s"),
        ("tokens/s", f"{r['tokens_per_s']:.1f}", f"{h['tokens_per_s']:.1f}"),
        ("hit rate", "-", f"{100 * h['hit_rate']:.1f} %"),
        ("hits", "-", h["hits"]),
        ("misses", "-", h["misses"]),
        ("host->device bytes", "-", fmt_bytes(h["host_to_device_bytes"])),
        (
            "host pool used / size",
            "-",
            f"{fmt_bytes(h['host_pool_used_bytes'])} / {fmt_bytes(h['host_pool_bytes'])}",
        ),
        ("device KV bytes", fmt_bytes(r["device_kv_bytes"]), fmt_bytes(h["device_kv_bytes"])),
        (
            "top-k overlap (consecutive steps)",
            f"{100 * r['topk_overlap']:.1f} %",
            f"{100 * h['topk_overlap']:.1f} %",
        ),
    ]
    w0 = max(len(a) for a, _, _ in rows)
    w1 = max(len("resident"), *(len(str(b)) for _, b, _ in rows))
    w2 = max(len("hisparse"), *(len(str(c)) for _, _, c in rows))
    lines = [
        f"{'':<{w0}}  {'resident':>{w1}}  {'hisparse':>{w2}}",
        f"{'-' * w0}  {'-' * w1}  {'-' * w2}",
    ]
    lines += [f"{a:<{w0}}  {str(b):>{w1}}  {str(c):>{w2}}" for a, b, c in rows]
    par = summary["parity"]
    lines.append(
        f"{'parity (tokens + final hidden states)':<{w0}}  "
        f"{('OK' if par['ok'] else 'FAILED'):>{w1 + w2 + 2}}"
    )
    if "metrics_endpoint" in summary:
        me = summary["metrics_endpoint"]
        lines.append(
            f"{'metrics endpoint port ' + str(me['port']):<{w0}}  "
            f"{('counters match' if me['matches'] else 'counters DIFFER'):>{w1 + w2 + 2}}"
        )
    return "\n".join(lines)
