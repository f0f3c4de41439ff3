"""The markdown table of a bench_decode_tpot.py result (engine_tpot_*.md)."""

from __future__ import annotations

import json
import sys


def _ms(row: dict, mode: str) -> str:
    lo, hi = row[f"{mode}_spread_ms"]
    return f"{row[f'{mode}_ms_per_step']:.3f} ({lo:.3f}-{hi:.3f})"


def markdown(res: dict) -> str:
    cfg = res["config"]
    out = [
        f"# Decode step time, resident vs HiSparse ({res['device']})",
        "",
        f"The core vLLM runs (`{res['core']}`): DeepSeek-V3.2's attention (MLA 128 heads, 656-B "
        f"FP8 rows, DSA indexer 64x128 over FP8 keys, top-k {cfg['top_k']}), {cfg['layers']} "
        f"layers, {cfg['mlp']}, LM head {cfg['vocab']}; context {cfg['context']} per request, hot "
        f"buffer {cfg['hot_size']} rows, about {cfg['miss']:.0%} of the top-k new per step; "
        f"attention: {cfg['attention']}. One CUDA graph per step and mode; median of "
        f"{res['rounds']} interleaved rounds x {res['steps']} steps (min-max of the round "
        "medians); ratio taken within each round.",
        "",
        "| batch | fits resident's budget | resident ms/step | HiSparse ms/step | HiSparse / "
        "resident | hit rate | tok/s resident / HiSparse | bit-identical |",
        "|---:|:---:|---|---|---:|---:|---|:---:|",
    ]
    for r in res["batches"]:
        out.append(
            f"| {r['batch']} | {'yes' if r['fits_resident_budget'] else 'no'} | "
            f"{_ms(r, 'resident')} | {_ms(r, 'hisparse')} | {r['ratio']:.3f} | "
            f"{r['hit_rate']:.3f} | {r['resident_tok_s']:.0f} / {r['hisparse_tok_s']:.0f} | "
            f"{'yes' if r['bit_identical'] else 'NO'} |"
        )
    c = res.get("capacity")
    if c:
        out += [
            "",
            f"Capacity in a {c['budget_gib']:g} GiB KV budget: resident fits "
            f"{c['max_batch']['resident']} requests ({c['tok_s']['resident']:.0f} tok/s), "
            f"HiSparse {c['max_batch']['hisparse']} ({c['tok_s']['hisparse']:.0f} tok/s): "
            f"{c['ratio']:.2f}x.",
        ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(markdown(json.load(open(sys.argv[1]))), end="")
