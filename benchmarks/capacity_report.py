"""Capacity by context length from bench_decode_tpot.py runs with --capacity (one JSON per
--context): each mode at the most requests the KV budget holds, its tokens/s, the ratio (both
modes of one run), and the commit the run measured. ``--ceilings`` adds what the ratio could be
if HiSparse's step cost resident's at the same batch (its misses' copy free) and if the misses
instead copied at the host link's bulk rate with nothing hiding them: the room left for hiding.

    python benchmarks/capacity_report.py benchmarks/results/engine_tpot_h200*.json \
        --out benchmarks/results/capacity_by_context_h200.md --ceilings
"""

from __future__ import annotations

import argparse
import json
import sys

from hisparse.models.rows import ROW_FORMATS


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


# A miss moves one FP8 row, the layout bench_decode_tpot's step stores.
ROW_BYTES = ROW_FORMATS["fp8"].row_bytes
# Pinned host -> device, one bulk cudaMemcpy on the H200's PCIe Gen5 x16 (docs/hardware.md):
# no gather of scattered rows moves faster.
LINK_GBPS = 55.5


def ceilings(runs: list, link_gbps: float = LINK_GBPS) -> str:
    """Per context: the ratio reached, the ratio if the misses' copy cost nothing (resident's
    step at HiSparse's limit, measured in the same run), and if it ran at ``link_gbps`` with
    nothing hiding it. Needs HiSparse's limit among the run's batches (both modes timed there)."""
    out = [
        "| context | ratio | copy free | copy at the link's rate, unhidden | misses per layer | "
        "copy per layer at the link's rate | HiSparse's extra per layer, measured |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(runs, key=lambda r: r["capacity"]["context"]):
        c = r["capacity"]
        limit = c["max_batch"]["hisparse"]
        row = next((b for b in r["batches"] if b["batch"] == limit), None)
        if row is None or "resident_ms_per_step" not in row:
            out.append(f"| {c['context']} | {c['ratio']:.2f}x | — | — | — | — | — |")
            continue
        layers = r["config"]["layers"]
        miss_bytes = limit * r["config"]["top_k"] * (1 - row["hit_rate"]) * ROW_BYTES
        copy_us = miss_bytes / (link_gbps * 1e3)
        res_ms = row["resident_ms_per_step"]
        copied_ms = res_ms + layers * copy_us / 1e3
        # HiSparse's tokens/s at its limit with that step, over resident's best
        free, copied = (limit / ms * 1e3 / c["tok_s"]["resident"] for ms in (res_ms, copied_ms))
        extra_us = (row["hisparse_ms_per_step"] - res_ms) / layers * 1e3
        out.append(
            f"| {c['context']} | {c['ratio']:.2f}x | {free:.2f}x | {copied:.2f}x | "
            f"{miss_bytes / 1e6:.2f} MB | {copy_us:.0f} µs | {extra_us:.0f} µs |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="bench_decode_tpot.py JSON files (with --capacity)")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--ceilings", action="store_true",
        help="add the ratio with the misses' copy free and at the link's bulk rate, unhidden",
    )  # fmt: skip
    ap.add_argument("--link-gbps", type=float, default=LINK_GBPS, help="host link's bulk GB/s")
    args = ap.parse_args(argv)
    runs = [json.load(open(p)) for p in args.runs]
    missing = [p for p, r in zip(args.runs, runs) if "capacity" not in r]
    if missing:
        ap.error(f"no capacity in {', '.join(missing)}: run bench_decode_tpot.py with --capacity")
    if args.link_gbps <= 0:
        ap.error(f"--link-gbps must be > 0, got {args.link_gbps}")
    md = table(runs)
    if args.ceilings:
        md += "\n\n" + ceilings(runs, args.link_gbps)
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
