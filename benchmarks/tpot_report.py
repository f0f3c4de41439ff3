"""The markdown tables of bench_decode_tpot.py's results (engine_tpot_*.md)."""

from __future__ import annotations


def _rng(m, k):
    v = m[k]
    return f"{v['ms_per_step']:.3f} ({v['ms_per_step_min']:.3f}-{v['ms_per_step_max']:.3f})"


def _whatif_table(res):
    """The capped-copy what-if (benchmarks/capped_gather.py), when it ran."""
    rows = [r for r in res["batches"] if "hisparse_capped" in r["modes"]]
    if not rows:
        return []
    out = [
        "",
        f"What-if, the misses' copy by a {res['args']['capped_blocks']}-CTA copy kernel instead "
        "of the op's full-GPU grid (benchmarks/capped_gather.py; same rows, same run):",
        "",
        "| batch | capped ms/step | ratio | split + capped ms/step | ratio | bit-identical |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["modes"]
        sc = m.get("hisparse_split_capped")
        ok = m["hisparse_capped"]["bit_identical_to_resident"] and (
            sc is None or sc["bit_identical_to_resident"]
        )
        out.append(
            f"| {r['batch']} | {_rng(m, 'hisparse_capped')} | {r['ratio_capped']:.3f} | "
            f"{_rng(m, 'hisparse_split_capped') if sc else '-'} | "
            f"{r['ratio_split_capped'] if sc else 0:.3f} | {ok} |"
        )
    return out


PATH_TABLES = {
    "in_read": (
        "in-read",
        'Misses read from the host pool inside attention\'s row read (`misses="in_read"`: no '
        "separate copy; the kernel also writes them to their hot rows), same run:",
    ),
    "beside": (
        "beside",
        "Misses copied by a Triton kernel on the copy stream while the rows already hot are read "
        '(`misses="beside"`), then the misses\' rows read, same run:',
    ),
}


def _path_table(res, path):
    """HiSparse with the misses brought in by another path than the op's gather, if run."""
    key, label, intro = f"hisparse_{path}", *PATH_TABLES[path]
    rows = [r for r in res["batches"] if key in r["modes"]]
    if not rows:
        return []
    out = [
        "",
        intro,
        "",
        f"| batch | {label} ms/step | ratio | added us/layer | split + {label} ms/step | ratio "
        "| bit-identical |",
        "|---|---|---|---|---|---|---|",
    ]
    layers = res["config"]["layers"]
    for r in rows:
        m = r["modes"]
        sp = m.get(f"hisparse_split_{path}")
        ok = m[key]["bit_identical_to_resident"] and (sp is None or sp["bit_identical_to_resident"])
        added = (m[key]["ms_per_step"] - m["resident"]["ms_per_step"]) / layers
        out.append(
            f"| {r['batch']} | {_rng(m, key)} | {m[key]['ratio']:.3f} | "
            f"{added * 1e3:.1f} | {_rng(m, f'hisparse_split_{path}') if sp else '-'} | "
            f"{sp['ratio'] if sp else 0:.3f} | {ok} |"
        )
    return out


def markdown(res):
    cfg = res["config"]
    out = [
        f"# Decode step time, resident vs HiSparse ({res['device']})",
        "",
        f"DeepSeek-V3.2 attention (MLA 128 heads, 656-B FP8 rows, DSA indexer 64x128, top-k "
        f"{cfg['top_k']}), {cfg['layers']} layers, dense MLP {cfg['mlp_inter']} (MoE's active "
        f"width), context {cfg['ctx_len']} per request, hot buffer {cfg['hot_size']} rows; one "
        f"CUDA graph per step; median of {res['args']['runs']} interleaved rounds x "
        f"{res['args']['steps']} steps (min-max of the round medians); ratio = same-round. "
        f"Row read and indexer: {res.get('kernels', 'torch')} kernels in every mode; attention: "
        f"{res.get('args', {}).get('attention', 'bmm')}.",
        "",
        "| batch | resident ms/step | HiSparse ms/step | ratio | no-overlap ms/step | ratio | "
        "split ms/step | ratio | hybrid ms/step | hit rate | ms/token res / HS | bit-identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["batches"]:
        m = r["modes"]
        sp = m.get("hisparse_split")
        hy = m.get("hybrid")
        ok = all(v["bit_identical_to_resident"] for v in m.values())
        out.append(
            f"| {r['batch']} | {_rng(m, 'resident')} | {_rng(m, 'hisparse')} | {r['ratio']:.3f} | "
            f"{_rng(m, 'hisparse_serial')} | {r['ratio_serial']:.3f} | "
            f"{_rng(m, 'hisparse_split') if sp else '-'} | {sp['ratio'] if sp else 0:.3f} | "
            f"{_rng(m, 'hybrid') + ' (' + str(hy['resident_requests']) + ' res)' if hy else '-'} | "
            f"{r['hit_rate']:.4f} | {m['resident']['ms_per_token']:.4f} / "
            f"{m['hisparse']['ms_per_token']:.4f} | {ok} |"
        )
    out += _whatif_table(res)
    for path in PATH_TABLES:
        out += _path_table(res, path)
    c = res["capacity"]
    out += [
        "",
        f"Capacity ({res['budget']}): resident best {c['resident_best_tok_s']:.0f} tok/s at "
        f"batch {c['resident_best_batch']} (fits {c['resident_max_batch']}); HiSparse "
        f"{c['hisparse_tok_s']:.0f} tok/s at batch {c['hisparse_batch']}: {c['ratio']:.2f}x."
        + (
            f" With the capped copy (what-if): {c['hisparse_capped_tok_s']:.0f} tok/s."
            if c.get("hisparse_capped_tok_s")
            else ""
        ),
        "",
        "Profile per layer (eager steps, CUDA events; us): resolve / gather (copy's own "
        "duration) / wait (main stream stalled for the copy) / added (graph step time over "
        "resident's, per layer)",
        "",
        "| batch | mode | resolve | gather | wait | added per layer |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["batches"]:
        for name, m in r["modes"].items():
            p = m.get("profile_per_layer")
            if p:
                add = (m["ms_per_step"] - r["resident_ms_per_step"]) * 1e3 / cfg["layers"]
                out.append(
                    f"| {r['batch']} | {name} | {p['resolve_us']:.1f} | {p['gather_us']:.1f} | "
                    f"{p['wait_us']:.1f} | {add:.1f} |"
                )
    return "\n".join(out) + "\n"
