"""The miss paths' kernels alone (hisparse.engine.graph.miss_kernels): the in-read row read
when ~5 % of the rows come over PCIe from the pinned pool, and the beside path's copy of those
rows, against the same read with every row hot (gather_decode), per launch shape.

    python benchmarks/bench_in_read.py --json benchmarks/results/in_read_h200.json

Per batch: each request's 2048 selected rows are distinct rows of its own 4096-row hot region;
`--miss` of them are planned misses whose host keys lie in the request's own 32k-token region of
a pinned pool (as a server's would). Every timed launch gets a plan with fresh host keys: the
GPU's L2 keeps host rows it read, so repeating one plan would time a cached copy. An in-read
launch is what the step runs: `stage_misses` (the plan into the pending table), the read, and
the clearing launch. The resolve op's own gather (`ops.gather`) moves the same plans. Median of
`--reps` launches (CUDA events).
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from cuda_timing import median_us, write_rows

from hisparse import ops
from hisparse.engine.graph import kernels, miss_kernels
from hisparse.engine.graph.config import ROW_BYTES

SHAPES = ((8, 2), (16, 4), (32, 4), (32, 8), (64, 8))  # (rows per program, warps)
TOP_K, HOT_SIZE, CTX = 2048, 4096, 32768  # DeepSeek-V3.2's top-k; the engine's hot and context
COPY_SHAPES = ((16, 64, 16), (32, 32, 8), (8, 64, 16), (32, 64, 16))  # (programs, rows, warps)


def plan(batch: int, top_k: int, hot: int, ctx: int, miss: float, g: torch.Generator, ids=None):
    """ids [batch, top_k] and the resolve op's plan (miss_src, miss_dst, miss_count)."""
    if ids is None:
        ids = torch.stack(
            [torch.randperm(hot, generator=g)[:top_k] + b * hot for b in range(batch)]
        )
    ids = ids.cpu()
    n_miss = int(round(miss * top_k))
    src = torch.zeros(batch, top_k, dtype=torch.int32)
    dst = torch.zeros(batch, top_k, dtype=torch.int32)
    for b in range(batch):
        dst[b, :n_miss] = ids[b, torch.randperm(top_k, generator=g)[:n_miss]]
        src[b, :n_miss] = (torch.randperm(ctx, generator=g)[:n_miss] + b * ctx).to(torch.int32)
    count = torch.full((batch,), n_miss, dtype=torch.int32)
    return ids.cuda(), (src.cuda(), dst.cuda(), count.cuda())


def miss_bench_args(argv, doc: str, batches: str):
    """The miss benches' shared arguments, parsed: --batches, --miss, --reps, --json."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--batches", default=batches)
    ap.add_argument("--miss", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    return args, [int(b) for b in args.batches.split(",")]


def pools(batch: int):
    """A pinned host pool with a 32k-token region per request and the hot rows, for `batch`."""
    host = torch.empty(batch * CTX, ROW_BYTES, dtype=torch.uint8).pin_memory()
    host.random_(0, 120)  # valid FP8 bytes (no NaN patterns)
    hot = torch.randint(0, 120, (batch * HOT_SIZE, ROW_BYTES), dtype=torch.uint8, device="cuda")
    return host, hot


def main(argv=None) -> int:
    args, batches = miss_bench_args(argv, __doc__, "1,16,64,112")
    top_k, hot_size, ctx = TOP_K, HOT_SIZE, CTX
    host, hot = pools(max(batches))
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        ids, _ = plan(b, top_k, hot_size, ctx, args.miss, g)
        moved = b * int(round(args.miss * top_k)) * ROW_BYTES
        # Enough distinct plans that the rows cycled through overflow the L2 (50 MB) three times.
        n = max(args.reps + 1, -(-(150 << 20) // moved))
        cycle = itertools.cycle(
            [plan(b, top_k, hot_size, ctx, args.miss, g, ids)[1] for _ in range(n)]
        )
        pending = torch.full((b * hot_size,), -1, dtype=torch.int32, device="cuda")

        def fresh(fn):
            return lambda: fn(next(cycle))

        def in_read(misses, blk, w):
            miss_kernels.stage_misses(pending, *misses)
            miss_kernels.read_rows_from_host(hot, host, pending, ids, block=blk, warps=w)
            miss_kernels.stage_misses(pending, *misses, clear=True)

        base = median_us(lambda: kernels.gather_decode(hot, ids), args.reps)
        row = dict(batch=b, all_hot_us=base, miss_bytes=moved, shapes={}, copy_shapes={})
        for blk, w in SHAPES:
            t = median_us(fresh(lambda m, blk=blk, w=w: in_read(m, blk, w)), args.reps)
            row["shapes"][f"{blk}x{w}"] = t
        t = median_us(fresh(lambda m: ops.gather([host], [hot], *m)), args.reps)
        row["op_gather"] = dict(us=t, gb_s=moved / t / 1e3)
        for progs, blk, w in COPY_SHAPES:

            def copy(m, blk=blk, progs=progs, w=w):
                miss_kernels.copy_misses(host, hot, *m, programs=progs, block=blk, warps=w)

            t = median_us(fresh(copy), args.reps)
            row["copy_shapes"][f"{progs}x{blk}x{w}"] = dict(us=t, gb_s=moved / t / 1e3)
        print(
            f"B={b}: all hot {base:.1f} us; in-read "
            + ", ".join(f"{k}: {v:.1f}" for k, v in row["shapes"].items())
            + f"; op gather {row['op_gather']['us']:.1f} us {row['op_gather']['gb_s']:.1f} GB/s"
            + "; copy "
            + ", ".join(
                f"{k}: {v['us']:.1f} us {v['gb_s']:.1f} GB/s" for k, v in row["copy_shapes"].items()
            ),
            flush=True,
        )
        rows.append(row)
    write_rows(args.json, rows, miss=args.miss)
    return 0


if __name__ == "__main__":
    sys.exit(main())
