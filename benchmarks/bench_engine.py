"""The headline: decode tokens/s against concurrency under one fixed GPU KV budget, on the
reference engine: all KV resident, HiSparse always-host, and HiSparse hybrid residency, up to well
past the point where resident runs out of memory. Every point runs --repeats times (default 3):
median and min-max.

    # H200 (about 6 minutes with the defaults):
    python benchmarks/bench_engine.py --device cuda
    # CPU, small mode (CI-sized):
    python benchmarks/bench_engine.py --device cpu --small

Method. One engine configuration; the GPU KV budget pays, per running request, for everything
the engine keeps on the device for it: resident = every KV row of its context in every layer +
its indexer keys; always-host = a hot buffer of `hot_size` rows and a device window of
`recent_window` rows per layer + its indexer keys (the full KV sits in the pinned host pool);
hybrid = device KV pages for as many requests as fit at full context, hot buffers + windows for
the rest (`hot_slots`), indexer keys for all; what is left of the budget becomes more pages. The
budget therefore fits `n_res` resident and `n_hs` HiSparse requests. At each concurrency c all c
requests are admitted together (prefill), then decode to the end; decode tokens/s is measured over
the decode-only steps (a device sync only where they start and end). Resident beyond `n_res` does
not fit: the point is reported as out of memory, and a server would stay at its `n_res` plateau,
so ratios past it are against resident's best median. Repeats are interleaved (mode by mode
within each repeat) so that drift of a shared machine hits every mode alike. Parity: every run's
tokens are compared with the first resident run at that level, or, past `n_res`, with the first
always-host run (itself checked against resident where both fit).
`--profile C` adds a torch.profiler breakdown of decode steps at concurrency C (where the step
time goes). Writes benchmarks/results/<name>.json, .md and .png (after every level).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hisparse.engine import EngineConfig, run_workload  # noqa: E402

GPU_DEFAULTS = dict(
    num_layers=8,
    index_share=2,
    hidden=64,
    indexer_dim=16,
    top_k=512,
    hot_size=1024,
    prompt_len=8192,
    output_len=128,
    recent_window=8,
    drift=0.05,
    metrics_interval=2000,
    length_jitter=0.0,
)
GPU_BUDGET_GIB = 2.0
GPU_CONCURRENCY = (1, 16, 128)  # plus both capacities (44 and 221 with the defaults)
SMALL_DEFAULTS = dict(
    num_layers=4,
    index_share=2,
    hidden=32,
    indexer_dim=16,
    top_k=32,
    hot_size=64,
    prompt_len=256,
    output_len=32,
    recent_window=8,
    drift=0.05,
    metrics_interval=2000,
    length_jitter=0.0,
)
SMALL_BUDGET_GIB = 4.0 / 1024
SMALL_CONCURRENCY = (1, 2, 4, 8, 16)


MODES = ("resident", "hisparse", "hybrid")  # "hisparse" = always-host (the name older results use)
LABELS = {
    "resident": "all KV resident",
    "hisparse": "HiSparse always-host",
    "hybrid": "HiSparse hybrid residency",
}


def _git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def indexer_bytes(cfg: EngineConfig) -> int:
    return cfg.max_context * cfg.num_groups * cfg.indexer_dim * (8 if cfg.dtype == "float64" else 4)


def per_request_device_bytes(cfg: EngineConfig, mode: str) -> int:
    """Device bytes the engine allocates per state row (= per running request), resident or
    always-host."""
    if mode == "resident":
        return cfg.max_context * cfg.num_layers * cfg.row_bytes + indexer_bytes(cfg)
    window = max(1, cfg.recent_window)
    return cfg.num_layers * (cfg.hot_size + window) * cfg.row_bytes + indexer_bytes(cfg)


def hybrid_sizing(cfg: EngineConfig, c: int, budget: int):
    """(device_pages, hot_slots) for c requests under the budget: as many requests as fit at
    full context get pages, the rest hot buffers; the remainder of the budget becomes pages.
    None when not even all-hot fits."""
    L, rb, bs = cfg.num_layers, cfg.row_bytes, cfg.block_size
    page = bs * L * rb
    hot = L * (cfg.hot_size + max(1, cfg.recent_window)) * rb
    full = cfg.pages_per_request * page
    kv = budget - c * indexer_bytes(cfg)
    if kv < c * hot:
        return None
    r = min(c, (kv - c * hot) // (full - hot)) if full > hot else c
    slots = c - r
    pages = (kv - slots * hot) // page
    return int(pages), int(slots)


def engine_config(cfg: EngineConfig, mode: str, c: int, budget: int) -> EngineConfig:
    c_cfg = cfg.replace(num_requests=c, max_running=c)
    if mode == "hybrid":
        pages, slots = hybrid_sizing(cfg, c, budget)
        return c_cfg.replace(residency="hybrid", device_pages=pages, hot_slots=slots)
    return c_cfg


def run_point(cfg: EngineConfig, mode: str, c: int, device: str, budget: int):
    c_cfg = engine_config(cfg, mode, c, budget)
    r = run_workload(c_cfg, mode="resident" if mode == "resident" else "hisparse", device=device)
    s = r.stats
    used = s.device_kv_bytes + s.indexer_bytes
    if mode == "hybrid":
        assert used <= budget, (used, budget, c)
    else:
        assert used == c * per_request_device_bytes(cfg, mode), (used, c, mode)
    row = dict(
        mode=mode,
        concurrency=c,
        status="ok",
        decode_tokens_per_s=s.decode_tokens_per_s,
        tokens_per_s=s.tokens_per_s,
        wall_s=s.wall_s,
        decode_wall_s=s.decode_wall_s,
        steps=s.steps,
        device_bytes=used,
        hit_rate=s.hit_rate if mode != "resident" else None,
        h2d_bytes=s.host_to_device_bytes,
        host_pool_bytes=s.host_pool_bytes,
        topk_overlap=s.topk_overlap,
        generated_tokens=s.generated_tokens,
    )
    if mode == "hybrid":
        row.update(
            device_pages=c_cfg.device_pages,
            hot_slots=c_cfg.hot_slots,
            spilled_requests=s.spilled_requests,
            mid_request_spills=s.mid_request_spills,
            returned_requests=s.returned_requests,
            spilled_bytes=s.spilled_bytes,
            peak_spilled=s.peak_spilled,
        )
    return row, r.tokens


def summarize(res: dict) -> dict:
    """Per (mode, level): median, min, max of decode tok/s over the repeats."""
    out: dict = {}
    for row in res["rows"]:
        if row["status"] != "ok":
            continue
        out.setdefault(row["mode"], {}).setdefault(row["concurrency"], []).append(
            row["decode_tokens_per_s"]
        )
    return {
        m: {
            c: dict(median=statistics.median(v), min=min(v), max=max(v), n=len(v))
            for c, v in lv.items()
        }
        for m, lv in out.items()
    }


def _cell(st) -> str:
    if st is None:
        return "out of memory"
    return f"{st['median']:,.0f} ({st['min']:,.0f}–{st['max']:,.0f})"


def markdown(res: dict) -> str:
    cfg = res["config"]
    summ = summarize(res)
    cap = res["capacity"]
    best_res = max((v["median"] for v in summ.get("resident", {}).values()), default=0.0)
    lines = [
        f"# Decode throughput vs concurrency under a {res['budget_gib']:g} GiB device KV budget",
        "",
        f"{res['env']['device_name']} ({res['device']}), torch {res['env']['torch']}, {res['env']['when']}, "
        f"commit {res['env'].get('commit', 'unknown')}. "
        f"Engine: {cfg['num_layers']} layers (index share {cfg['index_share']}), top-k {cfg['top_k']}, "
        f"hot buffer {cfg['hot_size']} rows, {res['row_bytes']}-B rows, prompt {cfg['prompt_len']}, "
        f"output {cfg['output_len']} tokens.",
        f"Per request on the device: resident {res['per_request_bytes']['resident'] / 2**20:.2f} MiB, "
        f"HiSparse {res['per_request_bytes']['hisparse'] / 2**20:.2f} MiB, so the budget fits "
        f"**{cap['resident']}** resident and **{cap['hisparse']}** HiSparse requests. Hybrid keeps as many "
        "requests in device pages as fit at full context and gives the rest hot buffers.",
        "",
        f"Decode tokens/s, median (min–max) of {res['repeats']} runs per point; ratios are of medians, "
        f"against resident at the same concurrency where it fits and against resident's best median "
        f"({best_res:,.0f} tok/s) beyond.",
        "",
        "| concurrency | resident | always-host | hybrid | hybrid ÷ resident | always-host ÷ resident "
        "| hybrid: paged / hot slots, requests spilled | hit rate (host, hybrid) | parity |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    levels = sorted({row["concurrency"] for row in res["rows"]})
    for c in levels:
        r, h, y = (summ.get(m, {}).get(c) for m in MODES)
        ref = r["median"] if r else best_res

        def ratio(x):
            return f"{x['median'] / ref:.2f}×" if x and ref else "-"

        hy_rows = [
            x
            for x in res["rows"]
            if x["mode"] == "hybrid" and x["concurrency"] == c and x["status"] == "ok"
        ]
        split = "-"
        if hy_rows:
            x = hy_rows[0]
            split = f"{c - x['hot_slots']} / {x['hot_slots']}, {x['spilled_requests']}"
        hrs = []
        for m in ("hisparse", "hybrid"):
            hr = [
                x["hit_rate"]
                for x in res["rows"]
                if x["mode"] == m
                and x["concurrency"] == c
                and x["status"] == "ok"
                and x["hit_rate"] is not None
            ]
            hrs.append(
                f"{100 * hr[0]:.1f} %"
                if hr and (m == "hisparse" or hy_rows and hy_rows[0]["hot_slots"])
                else "-"
            )
        par = res["parity"].get(str(c))
        ps = "-" if par is None else ("OK" if par else "FAILED")
        lines.append(
            f"| {c} | {_cell(r)} | {_cell(h)} | {_cell(y)} | {ratio(y)} | {ratio(h)} | {split} "
            f"| {hrs[0]}, {hrs[1]} | {ps} |"
        )
    top = {m: max(summ.get(m, {}).values(), key=lambda v: v["median"], default=None) for m in MODES}
    if best_res and (top["hisparse"] or top["hybrid"]):
        best = [f"resident {best_res:,.0f} tok/s"]
        for m, label in (("hisparse", "always-host"), ("hybrid", "hybrid")):
            if top[m]:
                v = top[m]["median"]
                best.append(f"{label} {v:,.0f} tok/s (**{v / best_res:.2f}×**)")
        lines += ["", "Best medians: " + ", ".join(best) + "."]
    steps = {}
    for x in res["rows"]:
        if x["status"] == "ok" and x.get("decode_wall_s") and x.get("steps", 0) > 1:
            steps.setdefault((x["mode"], x["concurrency"]), []).append(
                1e3 * x["decode_wall_s"] / (x["steps"] - 1)
            )
    if steps:
        lines += [
            "",
            "Decode step time, ms (median of the runs; every step decodes all running requests):",
            "",
            "| concurrency | " + " | ".join(LABELS[m] for m in MODES) + " |",
            "|---:|" + "---:|" * len(MODES),
        ]
        for c in levels:
            cells = [
                f"{statistics.median(steps[(m, c)]):.1f}" if (m, c) in steps else "-" for m in MODES
            ]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for note in res.get("notes", []):
        lines += ["", note]
    if res.get("profile"):
        lines += ["", "## Where a decode step's time goes", ""]
        for p in res["profile"]:
            lines += [
                f"### {LABELS[p['mode']]}, concurrency {p['concurrency']}: {p['steps']} decode steps, "
                f"{p['wall_ms_per_step']:.2f} ms wall per step, {p['device_ms_per_step']:.2f} ms of "
                f"device kernels+copies per step, {p['host_ops_per_step']:.0f} host-side ops per step",
                "",
                "```",
                p["table"],
                "```",
                "",
            ]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = summarize(res)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    colors = {"resident": "tab:grey", "hisparse": "tab:blue", "hybrid": "tab:green"}
    for mode in MODES:
        pts = sorted(summ.get(mode, {}).items())
        if not pts:
            continue
        cs = [c for c, _ in pts]
        med = [v["median"] for _, v in pts]
        lo = [v["median"] - v["min"] for _, v in pts]
        hi = [v["max"] - v["median"] for _, v in pts]
        ax.errorbar(
            cs,
            med,
            yerr=[lo, hi],
            fmt="o-",
            color=colors[mode],
            capsize=3,
            label=f"{LABELS[mode]} (median, min–max)",
        )
    n_res = res["capacity"]["resident"]
    rs = summ.get("resident", {})
    cs_all = sorted({x["concurrency"] for x in res["rows"]})
    if rs and cs_all and cs_all[-1] > n_res:
        best = max(v["median"] for v in rs.values())
        ax.plot(
            [n_res, cs_all[-1]],
            [best] * 2,
            "--",
            color="tab:grey",
            lw=1,
            label=f"resident capped at {n_res} running (KV budget)",
        )
        ax.plot(
            [n_res, cs_all[-1]],
            [3 * best] * 2,
            ":",
            color="tab:red",
            lw=1,
            label="3× resident's best",
        )
    if n_res:
        ax.axvline(n_res, color="tab:red", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"Reference engine, {res['budget_gib']:g} GiB device KV budget "
        f"({res['env']['device_name']}), {res['repeats']} runs per point",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(res: dict, stem: str) -> str:
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(res, stem + ".png")
    return md


def profile_point(
    cfg: EngineConfig, mode: str, c: int, device: str, budget: int, steps: int = 24
) -> dict:
    """torch.profiler over `steps` decode steps (after the prefill step) at concurrency c."""
    from torch.profiler import ProfilerActivity, profile

    c_cfg = engine_config(cfg, mode, c, budget)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    prof = profile(activities=acts)
    state = {"step": 0, "t0": None, "t1": None}

    def on_step(_tokens):
        state["step"] += 1
        if state["step"] == 2:  # after the prefill step and one decode step
            if device == "cuda":
                torch.cuda.synchronize()
            prof.start()
            state["t0"] = time.perf_counter()
        elif state["step"] == 2 + steps:
            if device == "cuda":
                torch.cuda.synchronize()
            state["t1"] = time.perf_counter()
            prof.stop()

    run_workload(
        c_cfg.replace(output_len=steps + 4),
        mode="resident" if mode == "resident" else "hisparse",
        device=device,
        progress=on_step,
    )
    ka = prof.key_averages()
    dev_attr = (
        "self_device_time_total"
        if hasattr(ka[0], "self_device_time_total")
        else "self_cuda_time_total"
    )
    dev_us = sum(getattr(e, dev_attr, 0) for e in ka)
    n_ops = sum(e.count for e in ka if not e.key.startswith(("cuda", "Memcpy", "Memset")))
    sort = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    try:
        table = ka.table(sort_by=sort, row_limit=18, max_name_column_width=48)
    except Exception:
        table = ka.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48)
    wall = (state["t1"] - state["t0"]) if state["t1"] else float("nan")
    return dict(
        mode=mode,
        concurrency=c,
        steps=steps,
        wall_ms_per_step=1e3 * wall / steps,
        device_ms_per_step=dev_us / 1e3 / steps,
        host_ops_per_step=n_ops / steps,
        table=table,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--small", action="store_true", help="the small CPU-sized configuration")
    ap.add_argument("--budget-gib", type=float, default=None, help="device KV budget (GiB)")
    ap.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated levels (default: a fixed set plus both capacities)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point (default 3)")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no new level after this many seconds (the results so far are kept)",
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="MODE:C,...",
        help="after the sweep, profile decode steps of these points, e.g. resident:44,hybrid:221",
    )
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--hot-size", type=int, default=None)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument(
        "--name", default=None, help="output file stem (default engine_concurrency[_small])"
    )
    ap.add_argument("--threads", type=int, default=1, help="CPU torch threads (default 1)")
    ap.add_argument("--no-parity", dest="parity", action="store_false")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU visible (use --device cpu --small)")
    modes = tuple(m for m in MODES if m in args.modes.split(","))
    if not modes or set(args.modes.split(",")) - set(MODES):
        ap.error(f"--modes must be a comma-separated subset of {MODES}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    small = args.small or args.device == "cpu"
    base = dict(SMALL_DEFAULTS if small else GPU_DEFAULTS)
    for flag, key in (
        ("prompt_len", "prompt_len"),
        ("output_len", "output_len"),
        ("top_k", "top_k"),
        ("hot_size", "hot_size"),
    ):
        v = getattr(args, flag)
        if v is not None:
            base[key] = v
    budget_gib = (
        args.budget_gib
        if args.budget_gib is not None
        else (SMALL_BUDGET_GIB if small else GPU_BUDGET_GIB)
    )
    if budget_gib <= 0:
        ap.error("--budget-gib must be > 0")
    levels = (
        tuple(int(x) for x in args.concurrency.split(","))
        if args.concurrency
        else (SMALL_CONCURRENCY if small else GPU_CONCURRENCY)
    )
    if any(c < 1 for c in levels):
        ap.error("--concurrency levels must be >= 1")
    profile = []
    for item in args.profile.split(",") if args.profile else []:
        m, _, c = item.partition(":")
        if m not in MODES or not c.isdigit() or int(c) < 1:
            ap.error(f"--profile items are MODE:C with MODE in {MODES}, got {item!r}")
        profile.append((m, int(c)))
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = EngineConfig(num_requests=1, max_running=1, **base)
    budget = int(budget_gib * 2**30)
    per = {m: per_request_device_bytes(cfg, m) for m in ("resident", "hisparse")}
    cap = {m: budget // per[m] for m in per}
    name = args.name or ("engine_concurrency_small" if small else "engine_concurrency")
    if args.device == "cuda":
        dev_name = torch.cuda.get_device_name(0)
    else:
        dev_name = platform.processor() or platform.machine()
    res = dict(
        device=args.device,
        budget_gib=budget_gib,
        config=cfg.to_dict(),
        row_bytes=cfg.row_bytes,
        per_request_bytes=per,
        capacity=cap,
        repeats=args.repeats,
        modes=list(modes),
        rows=[],
        parity={},
        profile=[],
        env=dict(
            torch=torch.__version__,
            device_name=dev_name,
            threads=torch.get_num_threads(),
            commit=_git_commit(),
            when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        ),
    )
    print(
        f"budget {budget_gib:g} GiB: resident fits {cap['resident']} requests "
        f"({per['resident'] / 2**20:.2f} MiB each), HiSparse {cap['hisparse']} "
        f"({per['hisparse'] / 2**20:.2f} MiB each)",
        flush=True,
    )
    # warm-up (CUDA context, kernels, allocator) outside the measurements
    warm = cfg.replace(prompt_len=min(cfg.prompt_len, 64), output_len=4)
    for mode in modes:
        run_workload(
            engine_config(warm, mode, 2, budget) if mode == "hybrid" else warm,
            mode="resident" if mode == "resident" else "hisparse",
            device=args.device,
        )
    extra = {cap[m] for m in cap if 0 < cap[m]} if not args.concurrency else set()
    # the capacities (the headline points) first, so that --max-seconds drops the others
    levels = sorted(extra, reverse=True) + sorted(set(levels) - extra)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, name)
    t_all = time.perf_counter()
    md = ""
    for c in levels:
        if args.max_seconds is not None and time.perf_counter() - t_all > args.max_seconds:
            print(f"  c={c}: skipped (--max-seconds {args.max_seconds:g} reached)", flush=True)
            res.setdefault("skipped_levels", []).append(c)
            continue
        fits = {
            m: (c <= cap["resident"] if m == "resident" else c <= cap["hisparse"]) for m in modes
        }
        for m in modes:
            if not fits[m]:
                res["rows"].append(
                    dict(mode=m, concurrency=c, status="out of memory", decode_tokens_per_s=None)
                )
                print(f"  c={c:4d} {m:<8}: out of memory", flush=True)
        ref_tokens, ok = None, True
        for rep in range(args.repeats):
            for m in modes:
                if not fits[m]:
                    continue
                row, tokens = run_point(cfg, m, c, args.device, budget)
                row["repeat"] = rep
                res["rows"].append(row)
                if args.parity:
                    if ref_tokens is None:
                        ref_tokens = tokens
                    elif tokens != ref_tokens:
                        ok = False
                        print(f"  c={c} {m} repeat {rep}: PARITY FAILED", flush=True)
                extra_s = ""
                if row["hit_rate"] is not None and (m == "hisparse" or row.get("hot_slots")):
                    extra_s = f", hit rate {100 * row['hit_rate']:.1f} %"
                if m == "hybrid":
                    extra_s += (
                        f", {c - row['hot_slots']} paged / {row['hot_slots']} hot slots, "
                        f"{row['spilled_requests']} spilled"
                    )
                print(
                    f"  c={c:4d} {m:<8} #{rep}: {row['decode_tokens_per_s']:10,.0f} decode tok/s "
                    f"({row['wall_s']:.1f} s{extra_s})",
                    flush=True,
                )
        if args.parity and sum(fits.values()) >= 2:
            res["parity"][str(c)] = ok
        res["total_s"] = time.perf_counter() - t_all
        md = write(res, stem)  # after every level: a cut-short run still leaves its results
    for m, c in profile:
        if c > (cap["resident"] if m == "resident" else cap["hisparse"]):
            print(f"  profile c={c} {m}: does not fit the budget, skipped", flush=True)
            continue
        p = profile_point(cfg, m, c, args.device, budget)
        res["profile"].append(p)
        print(
            f"  profile c={c} {m}: {p['wall_ms_per_step']:.2f} ms/step wall, "
            f"{p['device_ms_per_step']:.2f} ms/step device",
            flush=True,
        )
        res["total_s"] = time.perf_counter() - t_all
        md = write(res, stem)
    print()
    print(md)
    print(f"wrote {stem}.json, .md, .png ({res.get('total_s', 0):.0f} s)")
    return 0 if all(res["parity"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
