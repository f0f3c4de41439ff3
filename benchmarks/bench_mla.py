"""The fused sparse-MLA decode kernel alone (hisparse.models.dsa.kernels.mla.sparse_mla) per
launch shape, against the path it replaces: the Triton row read (gather_decode) then the two
batched products and the masked softmax of the core's "bmm" attention, timed the same way.

    python benchmarks/bench_mla.py --json benchmarks/results/mla_h200.json

DeepSeek-V3.2's shapes: 128 heads, 2048 selected 656-B FP8 rows per request, each request's
rows in its own region of a row buffer; each request's rows cut into `splits_for`'s number of
runs, as the decode step does. Median of `--reps` launches (CUDA events).
"""

from __future__ import annotations

import argparse
import sys

import torch
from cuda_timing import median_us, write_rows

from hisparse.engine.graph import GraphConfig
from hisparse.models.dsa.core import SparseMLACore
from hisparse.models.dsa.kernels.mla import sparse_mla, splits_for
from hisparse.models.dsa.kernels.rows import ROPE_AT, ROW_BYTES, SCALE_AT

SHAPES = (  # (heads per program, rows per block, warps, pipeline stages)
    (64, 16, 8, 2),
    (64, 16, 8, 1),
    (64, 32, 8, 2),
    (32, 16, 8, 1),
    (16, 32, 8, 2),
    (16, 16, 8, 1),
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,16,30,64,112")
    ap.add_argument("--rows-per-request", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = GraphConfig.deepseek_v32()
    core = SparseMLACore(cfg.dsa_config(), "fp8", "cuda", attention="bmm")
    g = torch.Generator(device="cuda").manual_seed(0)
    R, K = args.rows_per_request, cfg.top_k
    rows = []
    for n in (int(b) for b in args.batches.split(",")):
        src = torch.randint(0, 120, (n * R, ROW_BYTES), generator=g, device="cuda").to(torch.uint8)
        # Small scales and rope values: finite scores (random bytes there would overflow).
        src.view(torch.float32)[:, SCALE_AT : SCALE_AT + 4] = 0.01
        src.view(torch.bfloat16)[:, ROPE_AT:] = 0.01
        ids = torch.stack(
            [torch.randperm(R, generator=g, device="cuda")[:K] + b * R for b in range(n)]
        )
        q = torch.randn(n, cfg.heads, 576, generator=g, device="cuda").bfloat16()
        base = median_us(lambda: core.attend_latent(q, src, ids), args.reps)
        splits = splits_for(n, cfg.heads, "cuda")  # for the default heads per program
        row = dict(batch=n, bmm_path_us=base, splits=splits, shapes={})
        for hb, bn, w, st in SHAPES:
            scale = (cfg.nope + cfg.rope) ** -0.5

            def fused(hb=hb, bn=bn, w=w, st=st):
                cut = splits_for(n, cfg.heads, "cuda", heads_per_program=hb)
                sparse_mla(
                    q, src, ids, scale, heads_per_program=hb, block=bn, warps=w, stages=st,
                    splits=cut,
                )  # fmt: skip

            t = median_us(fused, args.reps)
            row["shapes"][f"{hb}x{bn}x{w}x{st}"] = dict(us=t, us_per_request=t / n, vs_bmm=t / base)
        print(
            f"B={n}: bmm path {base:.1f} us; "
            + ", ".join(f"{k}: {v['us']:.1f}" for k, v in row["shapes"].items()),
            flush=True,
        )
        rows.append(row)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
