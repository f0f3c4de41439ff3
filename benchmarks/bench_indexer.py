"""The fused DSA indexer kernel alone (hisparse.engine.graph.kernels.indexer_scores) per launch
shape: keys per tile, tiles per program, warps. Its time per request and layer is the largest
per-request cost of the decode step, so it bounds throughput at HiSparse's capacity.

    python benchmarks/bench_indexer.py --json benchmarks/results/indexer_h200.json

DeepSeek-V3.2's indexer: 64 heads x 128, FP8 keys with a float32 scale per token (132 B per
token). Median of `--reps` launches (CUDA events); effective bandwidth counts the keys and
scales read once plus the float32 scores written.
"""

from __future__ import annotations

import argparse
import sys

import torch
from cuda_timing import median_us, write_rows

from hisparse.engine.graph import kernels

SHAPES = (  # (block_t, tiles, warps)
    (128, 1, 4),
    (64, 1, 4),
    (256, 1, 8),
    (128, 1, 8),
    (64, 4, 4),
    (128, 2, 4),
    (128, 4, 8),
    (256, 2, 8),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="30,112")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in (int(b) for b in args.batches.split(",")):
        q = torch.randn(n, 64, 128, generator=g, device="cuda").bfloat16()
        hw = torch.randn(n, 64, generator=g, device="cuda").bfloat16()
        keys = torch.randn(n, args.ctx, 128, generator=g, device="cuda").to(torch.float8_e4m3fn)
        scales = torch.rand(n, args.ctx, generator=g, device="cuda") + 0.01
        moved = n * args.ctx * (128 + 4 + 4)
        row = dict(batch=n, ctx=args.ctx, shapes={})
        for bt, tiles, warps in SHAPES:
            us = median_us(
                lambda: kernels.indexer_scores(
                    q, hw, keys, scales, block_t=bt, tiles=tiles, warps=warps
                ),
                args.reps,
            )
            row["shapes"][f"{bt}x{tiles}x{warps}"] = dict(
                us=us, us_per_request=us / n, tb_s=moved / us / 1e6
            )
        best = min(row["shapes"], key=lambda k: row["shapes"][k]["us"])
        print(
            f"B={n}: "
            + ", ".join(f"{k}: {v['us']:.1f} us" for k, v in row["shapes"].items())
            + f"; best {best}",
            flush=True,
        )
        rows.append(row)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
