"""Gathers as a server sees them: each request's misses come from its own context region of a
large pinned pool, not uniformly from the whole pool (bench_ops.py's figure).

    python benchmarks/bench_gather_regions.py --json benchmarks/results/gather_regions_h200.json

Method. A pinned host pool (default 32 GiB) holds `--layers` layers of 656-byte rows, cut into
request slots of `ctx` tokens: layer-major (each layer a contiguous [slots * ctx, 656] view, a
request's rows of one layer contiguous) or token-major (one host row per token holding every
layer's row; a layer is a strided view, so one request's region of one layer spans `layers` times
as many bytes). Each batch row is a request in a distinct random slot; each timed call gathers
layer 0's misses of every request: `count` distinct random positions of its own context (102
= 5 % of top-k 2048, or all 2048), into distinct hot rows. A fresh plan per call; each call timed
alone with CUDA events after an L2-sized write and a spin (bench_ops.CudaTimer); median of
`--reps` calls with p10-p90. Same run: uniform-over-pool plans (bench_ops' method) and bulk
pinned host-to-device copies, the ceiling.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from bench_ops import CudaTimer, bench_memcpy, median, pct

from hisparse import ops

ROW = 656
H_HOT = 4096
I32 = torch.int32


def layer_view(pool, layout, layers, slots, ctx):
    """Layer 0's host view [slots * ctx, ROW] of the pool in the given layout."""
    n = slots * ctx
    if layout == "layer_major":
        return pool[: layers * n * ROW].view(layers, n, ROW)[0]
    return pool[: layers * n * ROW].view(n, layers, ROW)[:, 0]


def plan(B, count, ctx, slots, region, g):
    """Misses of each request from its own region (`region`) or the whole view (`pool`)."""
    if region == "pool":
        src = torch.randint(0, slots * ctx, (B, count), generator=g, device="cuda")
    else:
        slot = torch.randperm(slots, generator=g, device="cuda")[:B]
        pos = torch.rand(B, ctx, generator=g, device="cuda").argsort(dim=1)[:, :count]
        src = slot[:, None] * ctx + pos
    full = torch.zeros(B, 2048, dtype=I32, device="cuda")
    full[:, :count] = src.to(I32)
    dst = torch.arange(2048, device="cuda", dtype=I32)[None, :] + (
        torch.arange(B, device="cuda", dtype=I32)[:, None] * H_HOT
    )
    cnt = torch.full((B,), count, dtype=I32, device="cuda")
    return full, dst, cnt


def timed_plans(timer, reps, make_plan, fn) -> list:
    """us of `reps` calls of fn(plan), each on a fresh plan (after 3 warm-up calls)."""
    times = []
    for i in range(reps + 3):
        p = make_plan()
        t = timer.time_us(lambda: fn(p))
        if i >= 3:
            times.append(t)
    return times


def case(pool, timer, reps, layers, layout, ctx, B, count, region):
    slots = pool.numel() // (layers * ctx * ROW)
    if slots < B:
        return None
    host = layer_view(pool, layout, layers, slots, ctx)
    hot = torch.zeros(B * H_HOT, ROW, dtype=torch.uint8, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(ctx + B + count)
    times = timed_plans(
        timer, reps, lambda: plan(B, count, ctx, slots, region, g),
        lambda p: ops.gather([host], [hot], *p),
    )  # fmt: skip
    nbytes = B * count * ROW
    m = median(times)
    return dict(
        layout=layout,
        region=region,
        ctx=ctx,
        batch=B,
        misses_per_request=count,
        layers_in_pool=layers,
        slots=slots,
        bytes=nbytes,
        reps=reps,
        median_us=m,
        p10_us=pct(times, 10),
        p90_us=pct(times, 90),
        gbps=nbytes / (m * 1e-6) / 1e9,
    )


def markdown(res):
    out = [
        f"# Gathers from each request's own context region ({res['device']}, "
        f"{res['pool_gib']} GiB pinned pool, {res['layers']} layers in it, 656-B rows)",
        "",
        f"Bulk pinned H2D copy (same run): {res['memcpy']['gbps']:.1f} GB/s.",
        "",
        "| misses from | layout | ctx | batch | misses/request | median us (p10-p90) | GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["cases"]:
        out.append(
            f"| {r['region']} | {r['layout']} | {r['ctx']} | {r['batch']} | "
            f"{r['misses_per_request']} | {r['median_us']:.1f} ({r['p10_us']:.1f}-"
            f"{r['p90_us']:.1f}) | {r['gbps']:.1f} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-gib", type=float, default=32.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    pool = torch.empty(int(args.pool_gib * (1 << 30)), dtype=torch.uint8, pin_memory=True)
    timer = CudaTimer(2 * torch.cuda.get_device_properties(0).L2_cache_size)
    cases = []
    for layout in ("layer_major", "token_major"):
        for ctx in (8192, 32768, 131072):
            for B, count in ((1, 102), (1, 2048), (64, 102)):
                r = case(pool, timer, args.reps, args.layers, layout, ctx, B, count, "own")
                if r:
                    cases.append(r)
                    print(r, flush=True)
    for B, count in ((1, 102), (1, 2048), (64, 102)):
        r = case(pool, timer, args.reps, 1, "layer_major", 32768, B, count, "pool")
        cases.append(r)
        print(r, flush=True)
    res = dict(
        device=torch.cuda.get_device_name(),
        pool_gib=args.pool_gib,
        layers=args.layers,
        memcpy=bench_memcpy(pool, 10),
        cases=cases,
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
