"""`hisparse demo`: one workload run twice on the reference engine — every KV row on the device,
then HiSparse (host pool + small hot buffers) — with a bit-exact parity check and a summary."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from hisparse.cli.demo_report import (
    COUNTER_SERIES,
    fmt_bytes,
    scrape_counters,
    summary_table,
    tokens_digest,
)
from hisparse.cli.engine_args import engine_config_from_args
from hisparse.cli.errors import CommandError
from hisparse.engine import EngineConfig, compare_runs, run_workload
from hisparse.runtime.views import BindingError


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
    from hisparse.runtime.host_pool import _RESERVE_BYTES, available_host_bytes

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
                f"the {run} run needs {fmt_bytes(n)} of {where} memory for its KV but "
                f"{fmt_bytes(free)} is free: lower --prompt-len + --output-len ("
                f"{cfg.prompt_len} + {cfg.output_len}), --concurrency ({cfg.max_running}) or "
                f"--layers ({cfg.num_layers})",
                2,
            )
    return need


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
        try:
            exporter = _start_exporter(args.metrics_port)
        except CommandError:
            torch.set_num_threads(prev_threads)
            raise
        own_exporter = True
    try:
        if exporter is not None:
            print(
                f"serving metrics on http://127.0.0.1:{exporter.port}/metrics", file=out, flush=True
            )
        print(_workload_line(cfg, device), file=out, flush=True)
        results = _run_both(cfg, device, args, exporter, out)
        if isinstance(results, DemoOutcome):
            return results
        par = compare_runs(results["resident"], results["hisparse"])
        summary = _summary(cfg, device, results, par)
        if exporter is not None:
            summary["metrics_endpoint"] = _check_endpoint(exporter.port, summary["hisparse"])
    finally:
        if own_exporter:
            exporter.stop()
        torch.set_num_threads(prev_threads)
    _report(summary, par, args.json, out)
    ok = par.ok and summary.get("metrics_endpoint", {}).get("matches", True)
    return DemoOutcome(summary, 0 if ok else 1)


def _start_exporter(port: int):
    from hisparse.connector.exporter import HiSparseMetricsExporter

    exporter = HiSparseMetricsExporter(model_name="hisparse-demo")
    try:
        exporter.start(port)
    except OSError as e:
        raise CommandError(f"argument --metrics-port: {e}", 2) from None
    return exporter


def _workload_line(cfg: EngineConfig, device: str) -> str:
    return (
        f"workload: {cfg.num_requests} requests (<= {cfg.max_running} running), prompts "
        f"~{cfg.prompt_len}, outputs ~{cfg.output_len} tokens; {cfg.num_layers} layers in "
        f"{cfg.num_groups} index groups; top-k {cfg.top_k}, hot buffer {cfg.hot_size} rows, "
        f"{cfg.row_bytes}-B rows ({cfg.row_format}); device {device}"
    )


def _run_both(cfg: EngineConfig, device: str, args, exporter, out):
    """``{mode: result}`` of the resident run, then the HiSparse run; a ``DemoOutcome`` (parity
    failed) when a run is rejected at bind time."""
    from hisparse.engine import request_lengths

    total = sum(request_lengths(cfg)[1])
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
    return results


def _summary(cfg: EngineConfig, device: str, results: dict, par) -> dict:
    return {
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


def _check_endpoint(port: int, hisparse_stats: dict) -> dict:
    """The counters served on /metrics must be the ones the run counted."""
    scraped = scrape_counters(port)
    mine = {k: hisparse_stats[k] for k in COUNTER_SERIES}
    return {"port": port, "scraped": scraped, "matches": scraped == mine}


def _report(summary: dict, par, json_path: Optional[str], out) -> None:
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
    if json_path:
        d = os.path.dirname(os.path.abspath(json_path))
        os.makedirs(d, exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"summary written to {json_path}", file=out)


def _bar(total: int, desc: str, enabled: Optional[bool], out):
    if enabled is False:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total, desc=f"{desc:<8}", unit="tok", file=sys.stderr, leave=True, dynamic_ncols=True
    )


def main(args) -> int:
    return run_demo(args).exit_code
