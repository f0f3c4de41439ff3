"""Time per decode step of the code the vLLM classes run (``hisparse.models.dsa.core`` through
``hisparse.engine.graph``), resident against HiSparse, on a GPU at DeepSeek-V3.2's shapes:
hidden 7168, q_lora 1536, 128 heads, kv_lora 512 + rope 64 in 656-byte FP8 rows, indexer 64 x
128 over 132-byte FP8 keys, top-k 2048, an LM head of 129,280. The MoE is stood in by a dense
SwiGLU of its active width per token (8 routed + 1 shared expert x 2048 = 18432), so each layer
does the same matrix work per token. Weights are random bf16.

A step of ``--layers`` layers is captured as one CUDA graph per mode and replayed; the modes
interleave, ``--rounds`` rounds of ``--steps`` replays, the ratio taken within each round; both
modes' tokens and hidden states are compared bit for bit. About ``--miss`` of each request's
top-k is new each step (``hisparse.engine.graph.drift``); the hit rate is read from the resolve
op's counters. ``--capacity`` adds each mode at the most requests a 45 GiB KV budget over
DeepSeek-V3.2's 61 layers holds (``MemoryBudget``) and the tokens/s ratio.

    python benchmarks/bench_decode_tpot.py --capacity \
        --json benchmarks/results/engine_tpot_h200.json
    python benchmarks/bench_decode_tpot.py --context 131072 --batches "" --capacity --json ...
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

from hisparse.engine.graph import MODES, CoreStep, GraphConfig, MemoryBudget, measure
from hisparse.models.dsa.core import ATTENTION, MISSES, SparseMLACore

CORE = SparseMLACore.__module__  # what CoreStep's layers run (checked in run())


def _config(args) -> GraphConfig:
    return GraphConfig.deepseek_v32(
        ctx_len=args.context, hot_size=args.hot_size, layers=args.layers
    )


def run(args, batch: int, modes, resident_limit: int) -> dict:
    step = CoreStep(
        _config(args), batch, modes, "cuda", attention=args.attention, misses=args.misses,
        miss=args.miss,
    )  # fmt: skip
    assert type(step.core) is SparseMLACore and step.core.kernel_rows and step.core.kernel_index
    row = measure(step, args.rounds, args.steps)
    row["fits_resident_budget"] = batch <= resident_limit
    row["attention"] = step.core.attention  # what "auto" chose
    if "hisparse" in modes:  # where the misses reached the row read at this batch
        row["misses_read"] = "in_read" if step.core.reads_misses(batch) else "gather"
    del step
    torch.cuda.empty_cache()
    return row


def profile(args, batch: int, top: int) -> None:
    """GPU time per eager step and layer by kernel and by the torch op that launched it."""
    from torch.profiler import ProfilerActivity, profile

    step = CoreStep(
        _config(args), batch, MODES, "cuda", attention=args.attention, misses=args.misses,
        miss=args.miss,
    )  # fmt: skip
    for mode in MODES:
        for _ in range(2):
            step.stage()
            step.forward(mode)
        step.stage()  # one selection for the profiled steps: the staging's kernels stay out
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step.forward(mode)
            torch.cuda.synchronize()
        per = args.steps * args.layers
        kernels, launches = collections.Counter(), 0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:80]] += e.device_time / per
                launches += 1
        ops = collections.Counter()  # the same time by the torch op that launched it
        for e in prof.key_averages():
            if e.key.startswith("aten::") and e.self_device_time_total > 0:
                ops[e.key[:80]] += e.self_device_time_total / per
        print(
            f"\n{mode} batch {batch}: {sum(kernels.values()):.1f} us of kernels per layer, "
            f"{launches / per:.0f} launches per layer (LM head spread over the layers)"
        )
        for what, table in (("kernel", kernels), ("aten op", ops)):
            print(f"-- by {what}")
            for name, t in table.most_common(top):
                print(f"{t:9.1f} us  {name}")


def per_request_layer_us(rows: list, layers: int) -> dict:
    """Each mode's step cost per request and layer: the slope of ms/step against the batch
    between the smallest and the largest batch timed (what bounds the tokens/s at capacity)."""
    if len(rows) < 2:
        return {}
    lo, hi = min(rows, key=lambda r: r["batch"]), max(rows, key=lambda r: r["batch"])
    out = {}
    for m in MODES:
        key = f"{m}_ms_per_step"
        if key in lo and key in hi:
            slope = (hi[key] - lo[key]) / (hi["batch"] - lo["batch"]) / layers
            out[m] = round(slope * 1e3, 3)
    return {"batches": [lo["batch"], hi["batch"]], **out}


def capacity(args, rows: list, limit: dict) -> dict:
    """Each mode at its budget's limit: the batch table's row where it has one, else a run."""
    tok = {}
    hit = None
    for m in MODES:
        got = next((r for r in rows if r["batch"] == limit[m]), None)
        if got is None:
            got = run(args, limit[m], (m,), limit["resident"])
            print(json.dumps(got), flush=True)
        tok[m] = got[f"{m}_tok_s"]
        hit = got.get("hit_rate", hit) if m == "hisparse" else hit
    return {
        "budget_gib": MemoryBudget().kv_gib,
        "context": args.context,
        "max_batch": limit,
        "tok_s": tok,
        "ratio": round(tok["hisparse"] / tok["resident"], 3),
        "hit_rate": hit,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768, help="tokens per request")
    p.add_argument("--batches", default="1,16,30,64,112")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hot-size", type=int, default=4096)
    p.add_argument("--miss", type=float, default=0.05, help="new share of the top-k per step")
    p.add_argument(
        "--attention", choices=ATTENTION, default="auto",
        help="the core's sparse MLA; auto: FlashMLA where importable and faster, else bmm",
    )  # fmt: skip
    p.add_argument(
        "--misses", choices=MISSES, default="auto",
        help="HiSparse's misses: gathered before the row read, or fetched by it (in_read)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capacity", action="store_true", help="each mode at its budget's limit")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--profile", type=int, default=0, help="print the top N kernels and ops")
    args = p.parse_args(argv)
    try:
        batches = [int(x) for x in args.batches.split(",") if x]
        _config(args).check()
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        print("bench_decode_tpot needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.profile:
        for b in batches:
            profile(args, b, args.profile)
        return 0
    budget = MemoryBudget()
    limit = {m: budget.max_batch(_config(args), m == "resident") for m in MODES}
    rows = []
    for b in batches:
        t0 = time.time()
        rows.append(run(args, b, MODES, limit["resident"]))
        print(json.dumps(rows[-1]), f"({time.time() - t0:.0f} s)", flush=True)
    result = {
        "core": CORE,
        "device": torch.cuda.get_device_name(),
        "config": {
            "context": args.context,
            "layers": args.layers,
            "hot_size": args.hot_size,
            "top_k": 2048,
            "miss": args.miss,
            "attention": args.attention,
            "misses": args.misses,
            "mlp": "dense SwiGLU 18432 (the MoE's active width)",
            "vocab": GraphConfig().vocab,
        },
        "rounds": args.rounds,
        "steps": args.steps,
        "batches": rows,
        "per_request_layer_us": per_request_layer_us(rows, args.layers),
    }
    if args.capacity:
        result["capacity"] = capacity(args, rows, limit)
        print(json.dumps(result["capacity"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
