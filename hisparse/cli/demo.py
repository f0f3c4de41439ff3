"""`hisparse demo`: one workload on the DSA engine (hisparse.engine.dsa) in each residency mode
-- every latent row on the device (resident), the rows in the connector's host pool with small
hot buffers on the device (hisparse), and device pages under a block budget with whole requests
spilled to the host pool beyond it (hybrid) -- then a token-parity check and a summary. Exits 1
when the runs' tokens differ. The checkpoint is ``--model DIR`` or a tiny seeded one generated
for the run (hisparse.cli.demo_model); the workload comes from hisparse.cli.workload."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

from hisparse.cli import demo_model, workload
from hisparse.cli.demo_report import (
    COUNTER_SERIES,
    SPILL_SERIES,
    parity,
    run_stats,
    scrape_counters,
    spill_counters,
    summary_table,
    tokens_digest,
)
from hisparse.cli.errors import CommandError

MODES = ("resident", "hisparse", "hybrid")


@dataclass
class DemoOutcome:
    summary: dict
    exit_code: int


def plan(args) -> workload.Plan:
    """The checked workload of `demo`'s parsed ``args`` (one line naming a flag otherwise)."""
    hot = None if args.hot_size is None else [args.hot_size]
    return workload.plan(
        args, hot_flag="--hot-size", hot_sizes=hot, device_blocks=args.device_blocks
    )


def run_demo(args, p: workload.Plan, *, exporter=None, out=None) -> DemoOutcome:
    """Run the demo of parsed CLI ``args`` and their checked workload ``p``. ``exporter``: an
    already-started ``HiSparseMetricsExporter`` to report into (tests); otherwise
    ``--metrics-port`` starts one."""
    import torch

    out = sys.stdout if out is None else out
    prev_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    own_exporter = False
    try:
        if exporter is None and args.metrics_port is not None:
            exporter = _start_exporter(args.metrics_port)
            own_exporter = True
        summary = _run(p, args.progress, exporter, out)
    finally:
        if own_exporter:
            exporter.stop()
        torch.set_num_threads(prev_threads)
    _report(summary, args.json, out)
    ok = summary["parity"]["ok"] and summary.get("metrics_endpoint", {}).get("matches", True)
    return DemoOutcome(summary, 0 if ok else 1)


def _start_exporter(port: int):
    from hisparse.connector.exporter import HiSparseMetricsExporter

    exporter = HiSparseMetricsExporter(model_name="hisparse-demo")
    try:
        exporter.start(port)
    except OSError as e:
        raise CommandError(f"argument --metrics-port: {e}", 2) from None
    return exporter


def _run(p: workload.Plan, progress: bool, exporter, out) -> dict:
    """Every mode's run of the workload, then the summary."""
    import torch

    print(f"model: {p.model.describe()}", file=out, flush=True)
    ck = demo_model.load(p.model, torch.device(p.device))
    prompts = workload.prompts(ck, p)
    print(p.describe(), file=out, flush=True)
    if exporter is not None:
        print(
            f"serving metrics on http://127.0.0.1:{exporter.port}/metrics (the HiSparse run's "
            "counters, once it ends)",
            file=out,
            flush=True,
        )
    runs = {}
    for mode in MODES if p.device_blocks else MODES[:2]:
        runs[mode] = _generate(ck, p, mode, prompts, progress)
        if mode == "hisparse" and exporter is not None:
            # The engine hands its counters over once, at the end of the run.
            c = runs[mode].counters
            exporter.observe({k: [c.get(k, 0)] for k in COUNTER_SERIES})
        if mode == "hybrid" and exporter is not None:  # its moves, not its lookups
            moves = spill_counters(runs[mode].counters, ck.cfg.row_bytes(p.row_format))
            exporter.observe({k: [v] for k, v in moves.items()})
    summary = _summary(p, runs)
    if exporter is not None:
        row_bytes = ck.cfg.row_bytes(p.row_format)
        summary["metrics_endpoint"] = _check_endpoint(exporter.port, summary, row_bytes)
    return summary


def _generate(ck, p: workload.Plan, mode: str, prompts, progress: bool):
    import torch

    from hisparse.engine.dsa.generate import generate
    from hisparse.models.dsa.weights import CheckpointError

    bar = _bar(p.requests * p.new_tokens, mode, progress)

    def step(fn):
        logits = fn()  # one row per request in the step: one token each
        if bar is not None:
            bar.update(logits.shape[0])
        return logits

    try:
        return generate(
            ck, mode, p.row_format, torch.device(p.device), prompts, p.new_tokens,
            p.hot_sizes[0], max_batch=p.batch, step_hook=step,
            device_blocks=p.device_blocks if mode == "hybrid" else None,
        )  # fmt: skip
    except CheckpointError as e:
        raise CommandError(str(e), 2) from None
    finally:
        if bar is not None:
            bar.close()


def _summary(p: workload.Plan, runs: dict) -> dict:
    first = runs["resident"].tokens[0]
    summary = {
        "model": p.model.to_dict(),
        "workload": {k: v for k, v in p.to_dict().items() if k != "model"},
        "device": p.device,
        "tokens_sha256": tokens_digest(runs["resident"].tokens),
        **{m: run_stats(g) for m, g in runs.items()},
        "parity": parity({m: g.tokens for m, g in runs.items()}),
        "sample": bytes(t for t in first if t < 256).decode("latin-1"),
        "tokens": {m: g.tokens for m, g in runs.items()},
    }
    return summary


def _check_endpoint(port: int, summary: dict, row_bytes: int) -> dict:
    """The counters served on /metrics must be the ones the runs counted: the HiSparse run's
    lookups, the hybrid run's moves (zero without one)."""
    scraped = {**scrape_counters(port), **scrape_counters(port, series_of=SPILL_SERIES)}
    mine = {k: summary["hisparse"][k] for k in COUNTER_SERIES}
    hybrid = summary.get("hybrid", {}).get("counters", {})
    mine.update(spill_counters(hybrid, row_bytes))
    return {"port": port, "scraped": scraped, "matches": scraped == mine}


def _report(summary: dict, json_path: Optional[str], out) -> None:
    print(file=out)
    print(summary_table(summary), file=out)
    print(f"generated tokens sha256: {summary['tokens_sha256']}", file=out)
    print(f"request 0 generated (bytes): {summary['sample'][:60]!r}", file=out)
    if summary["hisparse"]["device_kv_bytes"] >= summary["resident"]["device_kv_bytes"]:
        print(
            "note: the hot buffers are as large as the whole context here, so HiSparse saves no "
            "device memory at this size (raise --prompt-len or lower --hot-size)",
            file=out,
        )
    if json_path:
        os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
        with open(json_path, "w") as f:
            json.dump(summary, f, indent=1)
        print(f"summary written to {json_path}", file=out)


def _bar(total: int, desc: str, enabled: Optional[bool]):
    if enabled is False:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total, desc=f"{desc:<8}", unit="tok", file=sys.stderr, leave=True, dynamic_ncols=True
    )
