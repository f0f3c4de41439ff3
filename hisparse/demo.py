"""`hisparse demo`: one workload run twice on the reference engine — every KV row on the device,
then HiSparse (host pool + small hot buffers) — with a bit-exact parity check and a summary."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import urllib.request
from dataclasses import dataclass
from typing import Optional

import torch

from hisparse.binding import BindingError
from hisparse.cli import CommandError
from hisparse.engine import EngineConfig, compare_runs, run_workload
from hisparse.limits import MAX_HOT_SIZE

# Counter data keys -> Prometheus series as exposed (counters get `_total`).
_SERIES = {
    "hits": "vllm:hisparse_cache_hits_total",
    "misses": "vllm:hisparse_cache_misses_total",
    "host_to_device_bytes": "vllm:hisparse_host_to_device_bytes_total",
}


def engine_config_from_args(args, **over) -> EngineConfig:
    """The EngineConfig the flags describe; ``over`` replaces fields before validation."""
    hot_size = getattr(args, "hot_size", None) or min(2 * args.top_k, MAX_HOT_SIZE)
    fields = dict(
        num_layers=args.layers,
        index_share=args.index_share,
        row_layout=args.row_layout,
        top_k=args.top_k,
        hot_size=hot_size,
        num_requests=args.requests,
        max_running=args.concurrency,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        drift=args.drift,
        recent_window=args.recent_window,
        seed=args.seed,
        metrics_interval=args.metrics_interval,
    )
    fields.update(over)
    return EngineConfig(**fields)


def memory_needs(cfg: EngineConfig) -> dict:
    """Bytes of the big allocations of each run: the resident run's device KV (every key row
    of every layer), the HiSparse run's device rows (recent window + hot buffers) and host pool
    (every key row plus one block of slack), as the engine allocates them."""
    per_row = cfg.row_bytes * cfg.num_layers
    window = max(1, cfg.recent_window)
    return {
        "resident_device": cfg.num_keys * per_row,
        "hisparse_device": cfg.num_state_rows * (window + cfg.hot_size) * per_row,
        "hisparse_host": (cfg.num_keys + cfg.block_size) * per_row,
    }


def check_memory(
    cfg: EngineConfig,
    device: str,
    *,
    host_free: Optional[int] = None,
    device_free: Optional[int] = None,
) -> dict:
    """Refuse, before anything is allocated, a workload whose KV cannot fit: the allocator
    would otherwise fail deep inside the run (a 27-line traceback, or the OOM killer)."""
    from hisparse.host_pool import _RESERVE_BYTES, available_host_bytes

    need = memory_needs(cfg)
    if host_free is None:
        host_free = max(0, available_host_bytes() - _RESERVE_BYTES)
    if device == "cuda":
        if device_free is None:
            device_free = torch.cuda.mem_get_info()[0]
        budgets = [
            ("resident", "device", need["resident_device"], device_free),
            ("HiSparse", "device", need["hisparse_device"], device_free),
            ("HiSparse", "host", need["hisparse_host"], host_free),
        ]
    else:  # both runs keep everything in RAM; they run one after the other
        budgets = [
            ("resident", "host", need["resident_device"], host_free),
            ("HiSparse", "host", need["hisparse_device"] + need["hisparse_host"], host_free),
        ]
    for run, where, n, free in budgets:
        if n > free:
            raise CommandError(
                f"the {run} run needs {_fmt_bytes(n)} of {where} memory for its KV but "
                f"{_fmt_bytes(free)} is free: lower --prompt-len + --output-len ("
                f"{cfg.prompt_len} + {cfg.output_len}), --concurrency ({cfg.max_running}) or "
                f"--layers ({cfg.num_layers})",
                2,
            )
    return need


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
    for key, series in _SERIES.items():
        total = 0.0
        for m in re.finditer(rf"^{re.escape(series)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", text, re.M):
            total += float(m.group(1))
        out[key] = int(total)
    return out


def _fmt_bytes(n: float) -> str:
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
        ("host->device bytes", "-", _fmt_bytes(h["host_to_device_bytes"])),
        (
            "host pool used / size",
            "-",
            f"{_fmt_bytes(h['host_pool_used_bytes'])} / {_fmt_bytes(h['host_pool_bytes'])}",
        ),
        ("device KV bytes", _fmt_bytes(r["device_kv_bytes"]), _fmt_bytes(h["device_kv_bytes"])),
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


@dataclass
class DemoOutcome:
    summary: dict
    exit_code: int


def run_demo(args, *, exporter=None, out=None) -> DemoOutcome:
    """Run the demo for parsed CLI ``args``. ``exporter``: an already-started
    ``HiSparseMetricsExporter`` to report into (tests); otherwise ``--metrics-port`` starts one."""
    out = sys.stdout if out is None else out
    cfg = engine_config_from_args(args)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise CommandError("argument --device: torch sees no CUDA GPU (use --device cpu)", 2)
    prev_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    own_exporter = False
    if exporter is None and args.metrics_port is not None:
        from hisparse.metrics import HiSparseMetricsExporter

        exporter = HiSparseMetricsExporter(model_name="hisparse-demo")
        try:
            exporter.start(args.metrics_port)
        except OSError as e:
            torch.set_num_threads(prev_threads)
            raise CommandError(f"argument --metrics-port: {e}", 2) from None
        own_exporter = True
    try:
        if exporter is not None:
            print(
                f"serving metrics on http://127.0.0.1:{exporter.port}/metrics", file=out, flush=True
            )
        from hisparse.engine import request_lengths

        total = sum(request_lengths(cfg)[1])
        print(
            f"workload: {cfg.num_requests} requests (<= {cfg.max_running} running), prompts "
            f"~{cfg.prompt_len}, outputs ~{cfg.output_len} tokens; {cfg.num_layers} layers in "
            f"{cfg.num_groups} index groups; top-k {cfg.top_k}, hot buffer {cfg.hot_size} rows, "
            f"{cfg.row_bytes}-B rows ({cfg.row_layout}); device {device}",
            file=out,
            flush=True,
        )
        results = {}
        for mode in ("resident", "hisparse"):
            bar = _bar(total, mode, args.progress, out)
            done = {"n": 0}

            def progress(n, bar=bar, done=done):
                if bar is not None:
                    bar.update(n - done["n"])
                done["n"] = n

            try:
                results[mode] = run_workload(
                    cfg,
                    mode=mode,
                    device=device,
                    progress=progress,
                    metrics=exporter if mode == "hisparse" else None,
                    binding_fault=args.binding_fault if mode == "hisparse" else None,
                )
            except BindingError as e:
                # The worker refuses overlapping per-layer views (the --binding-fault control).
                print(f"parity FAILED: the {mode} run was rejected at bind time: {e}", file=out)
                return DemoOutcome(
                    {
                        "config": cfg.to_dict(),
                        "device": device,
                        "parity": {"ok": False, "detail": f"BindingError: {e}"},
                    },
                    1,
                )
            finally:
                if bar is not None:
                    bar.close()
        par = compare_runs(results["resident"], results["hisparse"])
        summary = {
            "config": cfg.to_dict(),
            "device": device,
            "tokens_sha256": tokens_digest(results["hisparse"].tokens),
            "resident": results["resident"].stats.to_dict(),
            "hisparse": results["hisparse"].stats.to_dict(),
            "parity": {
                "ok": par.ok,
                "tokens_equal": par.tokens_equal,
                "hidden_equal": par.hidden_equal,
                "detail": par.describe(),
                "mismatched_requests": par.mismatched_requests,
            },
        }
        if exporter is not None:
            scraped = scrape_counters(exporter.port)
            h = summary["hisparse"]
            mine = {k: h[k] for k in _SERIES}
            summary["metrics_endpoint"] = {
                "port": exporter.port,
                "scraped": scraped,
                "matches": scraped == mine,
            }
    finally:
        if own_exporter:
            exporter.stop()
        torch.set_num_threads(prev_threads)
    print(file=out)
    print(summary_table(summary), file=out)
    print(f"generated tokens sha256: {summary['tokens_sha256']}", file=out)
    if summary["hisparse"]["device_kv_bytes"] >= summary["resident"]["device_kv_bytes"]:
        print(
            "note: the hot buffers are as large as the whole context here, so HiSparse saves no "
            "device memory at this size (raise --prompt-len or lower --hot-size)",
            file=out,
        )
    if not par.ok:
        print(par.describe(), file=out)
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"summary written to {args.json}", file=out)
    ok = par.ok and summary.get("metrics_endpoint", {}).get("matches", True)
    return DemoOutcome(summary, 0 if ok else 1)


def _bar(total: int, desc: str, enabled: Optional[bool], out):
    if enabled is False:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total, desc=f"{desc:<8}", unit="tok", file=sys.stderr, leave=True, dynamic_ncols=True
    )


def main(args) -> int:
    return run_demo(args).exit_code
