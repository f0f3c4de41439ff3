"""The resolve op's gather (`ops.gather`, CUDA) against the engine's Triton copy of the same plan
(`miss_kernels.copy_misses`) at several grid sizes, with misses from each request's own region
of a large pinned pool (bench_gather_regions.py's method: 32 GiB, 4 layers layer-major, 32k
tokens per request, a fresh plan per call, L2 flushed before each, median of `--reps` calls).

    python benchmarks/bench_gather_vs_copy.py

Why: a copy from a few SMs reached 44 GB/s in bench_in_read.py's small pool; this asks whether
the op's gather leaves bandwidth behind where a server's pool is large.
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_gather_regions import H_HOT, ROW, layer_view, plan, timed_plans
from bench_ops import CudaTimer, median

from hisparse import ops
from hisparse.engine.graph import miss_kernels

COPY_SHAPES = ((16, 64, 16), (32, 64, 16), (64, 32, 8), (132, 32, 8), (264, 32, 8), (528, 16, 4))
CASES = ((64, 102), (112, 102), (16, 102), (1, 2048))  # (batch, misses per request)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pool-gib", type=int, default=32)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    pool = torch.empty(args.pool_gib << 30, dtype=torch.uint8, pin_memory=True)
    timer = CudaTimer(2 * torch.cuda.get_device_properties(0).L2_cache_size)
    layers, ctx = 4, 32768
    slots = pool.numel() // (layers * ctx * ROW)
    host = layer_view(pool, "layer_major", layers, slots, ctx)
    for B, count in CASES:
        if B > slots:  # as bench_gather_regions does: each request needs a slot of its own
            print(f"B={B}: skipped, the pool holds {slots} requests (raise --pool-gib)")
            continue
        hot = torch.zeros(B * H_HOT, ROW, dtype=torch.uint8, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(ctx + B + count)
        variants = {"op": lambda p: ops.gather([host], [hot], *p)}
        for progs, blk, w in COPY_SHAPES:

            def copy(p, progs=progs, blk=blk, w=w):
                miss_kernels.copy_misses(host, hot, *p, programs=progs, block=blk, warps=w)

            variants[f"copy_{progs}x{blk}x{w}"] = copy

        def make(B=B, count=count, g=g):
            return plan(B, count, ctx, slots, "own", g)

        out = []
        for name, fn in variants.items():
            m = median(timed_plans(timer, args.reps, make, fn))
            out.append(f"{name} {m:.1f} us {B * count * ROW / m / 1e3:.1f} GB/s")
        print(f"B={B} x {count}: " + ", ".join(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
