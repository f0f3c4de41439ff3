"""Time per decode step and per output token of the GPU-bound engine (hisparse.engine.graph):
resident vs HiSparse (always-host; and hybrid where resident no longer fits) at DeepSeek-V3.2's
attention shapes, each mode one CUDA graph replayed per step.

    python benchmarks/bench_decode_tpot.py --json benchmarks/results/engine_tpot_h200.json

Method. One KV state (indexer cache and resident rows on the device, the same rows in a pinned
layer-major host pool, each request's context a contiguous host region) is shared by every mode.
Per batch, each mode is captured as one graph; then `--runs` rounds, modes interleaved in each
round, each mode `--steps` replays timed one by one with CUDA events around the replay (the next
step's staged selection bias is written between replays, outside the timed region). A mode's
figure is the median of its per-round medians, with the rounds' min and max; the ratio is the
median of same-round ratios. The hit rate is read from the resolve op's counters over the timed
steps. After the rounds every mode has run the same steps from the same start, so its tokens and
hidden state are compared bit for bit with resident's. Then eager steps (not captured) with CUDA
events at the phase boundaries split HiSparse's per-layer time into resolve, gather (the copy's
own duration, on the copy stream) and wait (the main stream's stall before attention).
Bit-identity across modes rests on cuBLAS's fixed-workspace mode, which importing
hisparse.engine.graph sets (before cuBLAS starts).
Capacity: `config.MemoryBudget` (a 61-layer model's KV state on one GPU of 8 x H200) gives each
mode's largest batch; throughput is batch / step time at that batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from capped_gather import cap_gathers
from tpot_report import markdown

from hisparse.engine.graph import (
    DecodeStep,
    Drift,
    GraphConfig,
    GraphStep,
    KVStore,
    MemoryBudget,
    Weights,
    counters,
    hit_rate,
    kernels,
    profile_eager,
)

# The step's miss paths besides the op's gather (DecodeStep(misses=...)), each timed on request.
PATHS = ("in_read", "beside")
PATH_MODES = tuple(f"hisparse{s}_{p}" for p in PATHS for s in ("", "_split"))


def med(xs):
    return statistics.median(xs)


def variants(budget, cfg, batch, args):
    """(name, mode, split, resident, overlap) timed at this batch."""
    out = [
        ("resident", "resident", 1, 0, True),
        ("hisparse", "hisparse", 1, 0, True),
        ("hisparse_serial", "hisparse", 1, 0, False),
    ]
    if batch >= 2:
        out.append(("hisparse_split", "hisparse", 2, 0, True))
    for path in PATHS:
        if path == "in_read" and args.attention == "fused":
            continue  # fused attention reads one buffer; the in-read path has no such form
        if getattr(args, path):
            out.append((f"hisparse_{path}", "hisparse", 1, 0, True))
            if batch >= 2:
                out.append((f"hisparse_split_{path}", "hisparse", 2, 0, True))
    r = budget.hybrid_resident(cfg, batch)
    if batch > budget.max_batch(cfg, True) and 0 < r < batch:
        out.append(("hybrid", "hybrid", 1, r, True))
    if args.capped_blocks:  # last: a failure here leaves the others measured
        out.append(("hisparse_capped", "hisparse", 1, 0, True))
        if batch >= 2:
            out.append(("hisparse_split_capped", "hisparse", 2, 0, True))
    return out


def run_batch(cfg, w, kv, budget, batch, args):
    """Every variant at one batch: interleaved timing rounds, hit rate, parity, eager profile."""
    graphs = {}
    for name, mode, split, res, overlap in variants(budget, cfg, batch, args):
        path = next((p for p in PATHS if name.endswith(f"_{p}")), "op")
        step = DecodeStep(
            cfg, w, kv, mode, batch, split=split, resident=res, overlap=overlap, fused=args.fused,
            misses=path, attention=args.attention,
        )  # fmt: skip
        drift = Drift(kv.max_batch, cfg.ctx_len, cfg.top_k, args.miss, "cuda", seed=11)
        try:
            if name.endswith("_capped"):
                cap_gathers(step, args.capped_blocks)
            graphs[name] = (GraphStep(step, drift, warmup=2), res)
        except Exception as e:  # only the what-if may fail (CuPy); the rest must not
            if not name.endswith("_capped"):
                raise
            print(f"skipped {name}: {type(e).__name__}: {e}", flush=True)
            torch.cuda.synchronize()
    rounds = {name: [] for name in graphs}
    stats = {name: [0, 0] for name in graphs}
    for _ in range(args.runs):
        for name, (gs, _) in graphs.items():
            for _ in range(args.warm):
                gs.stage_next()
                gs.replay()
            before = counters(gs.step)
            rounds[name].append(med(gs.timed_steps(args.steps)))
            after = counters(gs.step)
            stats[name][0] += after[0] - before[0]
            stats[name][1] += after[1] - before[1]
    ref = graphs["resident"][0].step
    row = dict(batch=batch, runs=args.runs, steps_per_run=args.steps, modes={})
    for name, (gs, res) in graphs.items():
        t = rounds[name]
        ratios = [a / b for a, b in zip(t, rounds["resident"])]
        same = torch.equal(gs.step.tokens, ref.tokens) and torch.equal(gs.step.hidden, ref.hidden)
        row["modes"][name] = dict(
            ms_per_step=med(t),
            ms_per_step_min=min(t),
            ms_per_step_max=max(t),
            ms_per_token=med(t) / batch,
            run_medians_ms=t,
            ratio=med(ratios),
            hit_rate=hit_rate((0, 0), tuple(stats[name])),
            bit_identical_to_resident=same,
            resident_requests=res if name == "hybrid" else None,
        )
    for name, (gs, _) in graphs.items():
        if name not in ("resident", "hisparse_serial") and not name.endswith("_in_read"):
            # (in-read has no copy of its own to time; beside's copy is timed like the op's)
            row["modes"][name]["profile_per_layer"] = profile_eager(gs, args.profile_steps)
    flat(row)
    del graphs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return row


def flat(row):
    """The issue's per-batch keys beside the per-mode detail."""
    m = row["modes"]
    row["resident_ms_per_step"] = m["resident"]["ms_per_step"]
    row["hisparse_ms_per_step"] = m["hisparse"]["ms_per_step"]
    row["ratio"] = m["hisparse"]["ratio"]
    row["hit_rate"] = m["hisparse"]["hit_rate"]
    if "hisparse_split" in m:
        row["hisparse_split_ms_per_step"] = m["hisparse_split"]["ms_per_step"]
        row["ratio_split"] = m["hisparse_split"]["ratio"]
    row["hisparse_serial_ms_per_step"] = m["hisparse_serial"]["ms_per_step"]
    row["ratio_serial"] = m["hisparse_serial"]["ratio"]
    if "hybrid" in m:
        row["hybrid_ms_per_step"] = m["hybrid"]["ms_per_step"]
    for k in ("hisparse_capped", "hisparse_split_capped", *PATH_MODES):
        if k in m:
            row[f"{k}_ms_per_step"] = m[k]["ms_per_step"]
            row[f"ratio_{k.removeprefix('hisparse_')}"] = m[k]["ratio"]


def capacity(rows, res_max, hs_max):
    def tok_s(r, key):
        return r["batch"] / r[key] * 1e3

    res = [r for r in rows if r["batch"] <= res_max]
    best = max(res, key=lambda r: tok_s(r, "resident_ms_per_step"))
    hs = next(r for r in rows if r["batch"] == hs_max)
    keys = ("hisparse", "hisparse_split", *PATH_MODES)
    hs_ms, hs_path = min((hs[f"{k}_ms_per_step"], k) for k in keys if f"{k}_ms_per_step" in hs)
    capped = [
        hs.get(k) for k in ("hisparse_capped_ms_per_step", "hisparse_split_capped_ms_per_step")
    ]
    capped = [c for c in capped if c is not None]
    return dict(
        hisparse_capped_tok_s=hs_max / min(capped) * 1e3 if capped else None,
        resident_max_batch=res_max,
        resident_best_batch=best["batch"],
        resident_best_tok_s=tok_s(best, "resident_ms_per_step"),
        hisparse_batch=hs_max,
        hisparse_tok_s=hs_max / hs_ms * 1e3,
        hisparse_variant=hs_path,
        ratio=(hs_max / hs_ms * 1e3) / tok_s(best, "resident_ms_per_step"),
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--hot", type=int, default=4096)
    ap.add_argument("--mlp-inter", type=int, default=18432)
    ap.add_argument("--batches", default="1,16,64", help="plus resident's and HiSparse's max")
    ap.add_argument("--kv-gib", type=float, default=45.0)
    ap.add_argument("--miss", type=float, default=0.05, help="target miss rate of the drift")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument(
        "--capped-blocks",
        type=int,
        default=0,
        help="what-if: also time HiSparse with capped_gather's copy of this many CTAs (0: off)",
    )
    ap.add_argument(
        "--in-read",
        action="store_true",
        help="also time HiSparse with the misses read from the host pool inside the row read",
    )
    ap.add_argument(
        "--torch-path",
        dest="fused",
        action="store_const",
        const=False,
        default=None,
        help="every mode without the Triton kernels (gather + decode_rows, bf16 indexer products)",
    )
    ap.add_argument(
        "--beside",
        action="store_true",
        help="also time HiSparse with the misses copied beside the read of the rows already hot",
    )
    ap.add_argument(
        "--attention",
        choices=("bmm", "fused"),
        default="bmm",
        help="every mode's attention: decoded rows + batched products, or the fused kernel",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = GraphConfig.deepseek_v32(
        layers=args.layers, ctx_len=args.ctx, hot_size=args.hot, mlp_inter=args.mlp_inter
    )
    budget = MemoryBudget(kv_gib=args.kv_gib)
    res_max, hs_max = max(1, budget.max_batch(cfg, True)), max(1, budget.max_batch(cfg, False))
    batches = sorted({int(b) for b in args.batches.split(",")} | {res_max, hs_max})
    t0 = time.time()
    w = Weights(cfg, "cuda")
    kv = KVStore(cfg, max(batches), "cuda")
    print(
        f"setup {time.time() - t0:.1f}s; resident max {res_max}, HiSparse max {hs_max}", flush=True
    )
    rows = []
    for b in batches:
        rows.append(run_batch(cfg, w, kv, budget, b, args))
        rows[-1]["fits_resident_budget"] = b <= res_max
        r = rows[-1]
        print(
            f"B={b}: res {r['resident_ms_per_step']:.3f} hs {r['hisparse_ms_per_step']:.3f} "
            f"ratio {r['ratio']:.3f} split {r.get('ratio_split', 0):.3f} hit {r['hit_rate']:.4f}",
            flush=True,
        )
    res = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        config=cfg.__dict__,
        kernels="triton" if kernels.use_triton(args.fused, "cuda") else "torch",
        budget=f"{budget.kv_gib:g} GiB of KV state per GPU over {budget.model_layers} layers",
        args=vars(args),
        batches=rows,
        capacity=capacity(rows, res_max, hs_max),
    )
    md = markdown(res)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        with open(args.json.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
