"""Capacity by context length from bench_decode_tpot.py runs (one JSON per --ctx): each mode's
largest batch in the KV budget, resident's best throughput, HiSparse's at its largest batch, and
the ratio, one row per context.

    python benchmarks/capacity_report.py benchmarks/results/engine_tpot_h200*.json \
        --out benchmarks/results/capacity_by_context_h200.md
"""

from __future__ import annotations

import argparse
import json
import sys


def table(runs: list) -> str:
    rows = sorted(runs, key=lambda r: r["config"]["ctx_len"])
    out = [
        "| context | resident fits | resident best tok/s (batch, ms/step) | HiSparse fits "
        "| HiSparse tok/s (ms/step, variant) | ratio | bit-identical |",
        "|---:|---:|---|---:|---|---:|---|",
    ]
    for r in rows:
        c = r["capacity"]
        best = next(b for b in r["batches"] if b["batch"] == c["resident_best_batch"])
        hs = next(b for b in r["batches"] if b["batch"] == c["hisparse_batch"])
        variant = c.get("hisparse_variant", "-")
        ok = all(m["bit_identical_to_resident"] for m in hs["modes"].values())
        out.append(
            f"| {r['config']['ctx_len']} | {c['resident_max_batch']} | "
            f"{c['resident_best_tok_s']:.0f} ({best['batch']}, "
            f"{best['resident_ms_per_step']:.2f}) | {c['hisparse_batch']} | "
            f"{c['hisparse_tok_s']:.0f} ({c['hisparse_batch'] / c['hisparse_tok_s'] * 1e3:.2f}, "
            f"{variant}) | {c['ratio']:.2f}x | {ok} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_decode_tpot.py JSON files")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    runs = [json.load(open(p)) for p in args.runs]
    md = table(runs)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
