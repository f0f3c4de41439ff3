"""Capacity by context length from bench_decode_tpot.py runs with --capacity (one JSON per
--context): each mode at the most requests the KV budget holds, its tokens/s, the ratio (both
modes of one run), and the commit the run measured.

    python benchmarks/capacity_report.py benchmarks/results/engine_tpot_h200*.json \
        --out benchmarks/results/capacity_by_context_h200.md
"""

from __future__ import annotations

import argparse
import json
import sys


def table(runs: list) -> str:
    rows = sorted(runs, key=lambda r: r["capacity"]["context"])
    out = [
        "| context | requests that fit: resident / HiSparse | resident tok/s | HiSparse tok/s "
        "| ratio | hit rate | commit |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        c = r["capacity"]
        n, tok = c["max_batch"], c["tok_s"]
        out.append(
            f"| {c['context']} | {n['resident']} / {n['hisparse']} | {tok['resident']:.0f} | "
            f"{tok['hisparse']:.0f} | {c['ratio']:.2f}x | {c['hit_rate']:.3f} | "
            f"{r.get('commit', '?')} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_decode_tpot.py JSON files (with --capacity)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = [json.load(open(p)) for p in args.runs]
    missing = [p for p, r in zip(args.runs, runs) if "capacity" not in r]
    if missing:
        ap.error(f"no capacity in {', '.join(missing)}: run bench_decode_tpot.py with --capacity")
    md = table(runs)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
