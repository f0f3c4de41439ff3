"""Run-to-run spread of the three resolve figures of the kernel-speed table (CUDA).

    python benchmarks/resolve_spread.py --runs 5 --json benchmarks/results/resolve_spread_h200.json

bench_ops.py times each figure once per run (the median of --reps calls); a figure close to its
goal needs more than two runs to say which side of it it is on. This repeats, in one process,
only the resolve workloads of that table with bench_ops' method (drifting trace, L2 flushed and
GPU kept busy before each event-timed call): batch 64 @0.1 % as a graph replay, batch 256 @20 %,
and batch 1 from an empty state (100 % misses). Each run builds its inputs afresh (its own
seed); the output lists every run's median and, per workload, the median, minimum and maximum
over the runs. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import CudaTimer, ResolveSetup, graph_resolve, timed_steps  # noqa: E402

WORKLOADS = (  # (name, batch, miss rate, timed as a graph replay)
    ("batch 64 @0.1 % misses, graph replay", 64, 0.001, True),
    ("batch 256 @20 %", 256, 0.20, False),
    ("batch 1, cold (100 % misses)", 1, 1.0, False),
)
GOAL_US = 10.0, 20.0, 10.0


def one_run(run: int, reps: int, timer: CudaTimer) -> list[float]:
    out = []
    for _, B, rate, graph in WORKLOADS:
        st = ResolveSetup(B, "cuda", seed=1000 * run + B)
        pre = st.reset if rate == 1.0 else None
        st.call()
        for _ in range(3):
            st.advance(rate)
            st.call()
        if graph:
            out.append(graph_resolve(st, rate, reps, timer, pre))
        else:
            out.append(timed_steps(st, rate, reps, timer, st.call, pre))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="independent runs (default 5)")
    ap.add_argument("--reps", type=int, default=200, help="timed calls per figure (default 200)")
    ap.add_argument("--json", help="write results here (and a markdown table next to it)")
    args = ap.parse_args(argv)
    if args.runs < 1 or args.reps < 1:
        ap.error("--runs and --reps must be at least 1")
    if not torch.cuda.is_available():
        sys.exit("resolve_spread.py: no CUDA device (this benchmark times the CUDA kernel)")
    props = torch.cuda.get_device_properties(0)
    timer = CudaTimer(max(2 * props.L2_cache_size, 64 << 20))
    runs = []
    for run in range(args.runs):
        runs.append(one_run(run, args.reps, timer))
        print(f"run {run + 1}: " + ", ".join(f"{v:.1f} us" for v in runs[-1]), flush=True)
    rows = []
    for j, (name, B, rate, graph) in enumerate(WORKLOADS):
        vals = [r[j] for r in runs]
        rows.append(
            dict(
                workload=name,
                batch=B,
                miss_rate=rate,
                graph=graph,
                goal_us=GOAL_US[j],
                runs_us=vals,
                median_us=statistics.median(vals),
                min_us=min(vals),
                max_us=max(vals),
            )
        )
    lines = [
        f"# resolve spread — {props.name}\n",
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"top-k 2048, hot 4096; {args.runs} runs, each figure the median of {args.reps} "
        "event-timed calls (L2 flushed, GPU kept busy before each call).\n",
        "| workload | median of runs µs | min–max µs | goal µs | runs µs |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['median_us']:.2f} | {r['min_us']:.2f}–{r['max_us']:.2f} | "
            f"≤ {r['goal_us']:g} | {', '.join(f'{v:.2f}' for v in r['runs_us'])} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            out = dict(device=props.name, runs=args.runs, reps=args.reps, rows=rows)
            json.dump(out, f, indent=1)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
