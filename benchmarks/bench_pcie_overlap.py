"""Does a host -> device transfer overlap the HBM-bound row read? The all-hot row read
(gather_decode) at DeepSeek-V3.2's shapes, alone and with the misses' bytes moved beside it on
a second stream, moved four ways: by SM loads from the pinned pool (the plan's scattered rows:
the engine's copy_misses at two launch shapes, and warp_gather.py's CUDA copy from a few CTAs),
by bulk copies (tma_gather.py) and by the copy engine (one contiguous pinned buffer of the same
size).

    python benchmarks/bench_pcie_overlap.py --json benchmarks/results/pcie_overlap_h200.json

Each variant is one CUDA graph (fork / join captured), timed by CUDA events around its replay,
median of `--reps` replays. Before each replay, outside the timed span, a fresh plan is copied
into the graph's plan buffers: the L2 keeps host rows an SM read, so one repeated plan would
time a cached copy. Overlap = (A + C - both) / min(A, C): 1 when the shorter one hides fully.
"""

from __future__ import annotations

import statistics
import sys

import torch
from bench_in_read import CTX, HOT_SIZE, TOP_K, miss_bench_args, plan, pools
from cuda_timing import write_rows
from tma_gather import tma_gather
from warp_gather import warp_gather

from hisparse.engine.graph import kernels, miss_kernels
from hisparse.engine.graph.config import ROW_BYTES

TMA_SHAPES = ((132, 64),)  # (CTAs, rows in flight per CTA)
# (CTAs, threads, rows in flight per warp, reserved shared memory bytes per CTA)
WARP_SHAPES = ((16, 512, 4, 0), (32, 256, 4, 0), (8, 512, 8, 0))


def timed(graph, before, reps):
    ts = []
    for _ in range(reps):
        before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main(argv=None) -> int:
    args, batches = miss_bench_args(argv, __doc__, "64,112")
    top_k, hot_size, ctx = TOP_K, HOT_SIZE, CTX
    host, hot = pools(max(batches))
    g = torch.Generator().manual_seed(0)
    side = torch.cuda.Stream()
    rows = []
    for b in batches:
        ids, _ = plan(b, top_k, hot_size, ctx, args.miss, g)
        plans = [plan(b, top_k, hot_size, ctx, args.miss, g, ids)[1] for _ in range(args.reps)]
        live = [t.clone() for t in plans[0]]
        moved = b * int(round(args.miss * top_k)) * ROW_BYTES
        staging = torch.empty(moved, dtype=torch.uint8).pin_memory()
        landing = torch.empty(moved, dtype=torch.uint8, device="cuda")
        out = torch.empty(b, top_k, 576, dtype=torch.bfloat16, device="cuda")
        work = {
            "read": lambda: kernels.gather_decode(hot, ids, out=out),
            "sm_copy_16x64x16": lambda: miss_kernels.copy_misses(host, hot, *live),
            "sm_copy_32x32x8": lambda: miss_kernels.copy_misses(
                host, hot, *live, programs=32, block=32, warps=8
            ),
            "dma_copy": lambda: landing.copy_(staging, non_blocking=True),
        }
        for ctas, slots in TMA_SHAPES:
            work[f"tma_copy_{ctas}x{slots}"] = lambda c=ctas, s=slots: tma_gather(
                host, hot, *live, ctas=c, slots=s
            )
        for c, t, r, res in WARP_SHAPES:
            work[f"warp_copy_{c}x{t}r{r}" + ("s" if res else "")] = lambda c=c, t=t, r=r, res=res: (
                warp_gather(host, hot, *live, ctas=c, threads=t, rows=r, reserve=res)
            )

        def capture(main_work, side_work=None):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                if side_work is not None:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        work[side_work]()
                work[main_work]()
                if side_work is not None:
                    torch.cuda.current_stream().wait_stream(side)
            return graph

        turn = iter(range(10**9))

        def fresh():
            for t, src in zip(live, plans[next(turn) % len(plans)]):
                t.copy_(src)

        for w in work.values():
            w()  # compile
        torch.cuda.synchronize()
        src, dst, count = (t.cpu() for t in live)
        planned = [
            (dst[r, : int(count[r])].long(), src[r, : int(count[r])].long()) for r in range(b)
        ]
        for name in [n for n in work if n.startswith(("tma", "warp", "sm_"))]:
            for d, _ in planned:
                hot[d.cuda()] = 0  # every planned row cleared, so a copy that did nothing shows
            work[name]()
            for d, k in planned:
                assert torch.equal(hot[d.cuda()], host[k].cuda()), f"{name} copied wrong rows"
        alone = {name: timed(capture(name), fresh, args.reps) for name in work}
        row = dict(batch=b, miss_bytes=moved, alone_us=alone, beside_read_us={}, overlap={})
        for copy in [n for n in work if n != "read"]:
            both = timed(capture("read", copy), fresh, args.reps)
            row["beside_read_us"][copy] = both
            a, c = alone["read"], alone[copy]
            row["overlap"][copy] = (a + c - both) / min(a, c)
        print(
            f"B={b} ({moved / 1e6:.1f} MB): "
            + ", ".join(f"{k} {v:.1f} us" for k, v in alone.items())
            + "; read with "
            + ", ".join(
                f"{k} {row['beside_read_us'][k]:.1f} us (overlap {row['overlap'][k]:.2f})"
                for k in row["beside_read_us"]
            ),
            flush=True,
        )
        rows.append(row)
    write_rows(args.json, rows, miss=args.miss)
    return 0


if __name__ == "__main__":
    sys.exit(main())
