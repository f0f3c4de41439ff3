"""The headline: decode tokens/s against concurrency under one fixed GPU KV budget, on the DSA
engine (``hisparse.engine.dsa``: DeepSeek-V3.2 / GLM-5 checkpoints): all KV resident, HiSparse
always-host, and HiSparse hybrid residency, up to the most requests HiSparse fits. Every point
runs --repeats times (default 3): median and min-max.

    # H200 (about 4 minutes with the defaults):
    python benchmarks/bench_engine.py --device cuda
    # CPU, small mode (CI-sized, well under a minute):
    python benchmarks/bench_engine.py --device cpu --small

The model: the tiny seeded checkpoint ``hisparse demo`` generates (``hisparse.cli.demo_model``:
GLM-5 by default, real latent sizes, 656-B FP8 rows; --arch, --layers, --index-share, --top-k,
--seed, --drift, the last so that the indexer's query moves slowly from step to step, as a
trained model's does), or --model DIR (a real or exported checkpoint). Every request has a
prompt of --prompt-len byte tokens and decodes --output-len tokens; all c requests are admitted
(one prefill per step) before the batch decodes, so every decode step decodes all c
(``generate(prefill_first=True)``).

Method. The GPU KV budget pays, per running request, for everything the engine keeps on the
device for it (``hisparse.engine.dsa.budget``): resident = every row of its context in every
layer + its index keys; always-host = a hot buffer of --hot-size rows per layer + its index keys
(its rows sit in the pinned host pool); hybrid = index keys for every request, hot buffers for
the requests the budget cannot hold resident (at least one) and the rest of the budget as device
blocks, where requests stay resident while they fit (spilled whole beyond; ``DeviceKV.
hybrid_split``). Each run's buffers are
checked against this. Resident beyond its capacity does not fit: the point is reported as out of
memory, and ratios past it are against resident's best median. Decode tokens/s is taken over the
decode-only steps after the first two (``hisparse.engine.dsa.clock``: the first step of a batch
size runs eagerly, the second captures its CUDA graph), a device sync only where they start and
end. Every mode replays CUDA graphs on CUDA (hybrid: one per split of the batch between
resident and spilled requests; --eager steps them all eagerly); each row records which. Repeats are interleaved (mode by mode within each repeat) so that
drift of a shared machine hits every mode alike. Parity: every run's tokens equal the first
resident run's at that level, or, past resident's capacity, the first always-host run's. `--profile MODE:C` adds a torch.profiler breakdown of decode steps
at concurrency C. Writes <out-dir>/<name>.json, .md and .png (after every level).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hisparse.engine.dsa import generate as gen  # noqa: E402
from hisparse.engine.dsa.budget import DeviceKV, context_rows  # noqa: E402
from hisparse.engine.dsa.clock import UNTIMED_DECODES  # noqa: E402

GPU = dict(
    top_k=256,
    hot_size=512,
    prompt_len=4096,
    output_len=128,
    budget_gib=0.3,
    concurrency=(1, 16),
)
SMALL = dict(
    top_k=16,
    hot_size=32,
    prompt_len=96,
    output_len=16,
    budget_gib=1.5 / 1024,
    concurrency=(1, 2, 8),
)
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


def load_model(args, device: torch.device):
    """(checkpoint, its description): --model, or the tiny seeded one ``hisparse demo`` runs
    (``hisparse.cli.demo_model``: --arch, --layers, --index-share, --top-k, --seed, --drift)."""
    from hisparse.cli.demo_model import choose, load
    from hisparse.cli.errors import CommandError

    try:
        choice = choose(args, context_rows(args.prompt_len + args.output_len))
        if args.prompt_len + args.output_len > choice.max_positions:
            raise CommandError(
                f"prompt + output exceed the model's {choice.max_positions} positions"
            )
        return load(choice, device), choice
    except CommandError as e:
        raise SystemExit(f"bench_engine.py: {e}") from None


def prompts(ck, count: int, length: int):
    """``count`` prompts of ``length`` byte tokens, each its own text at its own offset."""
    out = []
    for i in range(count):
        text = gen.TEXTS[i % len(gen.TEXTS)].encode()
        data = text * (length // len(text) + 2)
        start = (13 * i) % len(text)
        out.append([b % ck.spec.vocab_size for b in data[start : start + length]])
    return out


def run_point(ck, args, mode: str, c: int, device, kv: DeviceKV, budget: int):
    blocks, hot = kv.hybrid_split(c, budget) if mode == "hybrid" else (None, None)
    g = gen.generate(
        ck,
        mode,
        args.row_format,
        device,
        prompts(ck, c, args.prompt_len),
        args.output_len,
        args.hot_size,
        device_blocks=blocks,
        hot_slots=hot,
        prefill_first=True,
        graphs=False if args.eager else None,
    )
    used = sum(g.device_bytes.values())
    want = kv.total(mode, c, blocks or 0, hot)
    assert used == want <= budget, (mode, c, used, want, budget)  # the accounting is the run's
    assert g.decode_steps == args.output_len - 1 - UNTIMED_DECODES, g.decode_steps
    assert g.decode_tokens == c * g.decode_steps, (g.decode_tokens, c)
    hits, misses = g.counters.get("hits", 0), g.counters.get("misses", 0)
    row = dict(
        mode=mode,
        concurrency=c,
        status="ok",
        decode_tokens_per_s=g.decode_tokens / g.decode_seconds,
        decode_s=g.decode_seconds,
        decode_steps=g.decode_steps,
        wall_s=g.seconds,
        device_bytes=used,
        execution="graphs" if g.graph_replays else "eager",
        graph_replays=g.graph_replays,
        hit_rate=hits / (hits + misses) if hits + misses else None,
        h2d_bytes=g.counters.get("host_to_device_bytes", 0),
    )
    if mode == "hybrid":
        keep = ("spills", "spilled_requests", "returns", "peak_spilled")
        row.update(device_blocks=blocks, hot_slots=hot, **{k: g.counters.get(k, 0) for k in keep})
    return row, g.tokens


def summarize(res: dict) -> dict:
    """Per (mode, level): median, min, max of decode tok/s over the repeats."""
    out: dict = {}
    for row in res["rows"]:
        if row["status"] == "ok":
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


def ratios(res: dict) -> dict:
    """Per level: each HiSparse mode's median ÷ resident's median at that level (where resident
    fits) or resident's best median (beyond), and the per-repeat range where both ran."""
    summ = summarize(res)
    rs = summ.get("resident", {})
    best = max((v["median"] for v in rs.values()), default=None)
    by = {
        (r["mode"], r["concurrency"], r.get("repeat")): r["decode_tokens_per_s"]
        for r in res["rows"]
        if r["status"] == "ok"
    }
    out: dict = {}
    for m in ("hybrid", "hisparse"):
        for c, st in summ.get(m, {}).items():
            ref = rs[c]["median"] if c in rs else best
            if not ref:
                continue
            per = [
                by[m, c, k] / by["resident", c, k]
                for k in range(res["repeats"])
                if (m, c, k) in by and ("resident", c, k) in by
            ]
            out.setdefault(str(c), {})[f"{m}/resident"] = dict(
                median=st["median"] / ref,
                against="same level" if c in rs else "resident's best",
                per_repeat_min=min(per, default=None),
                per_repeat_max=max(per, default=None),
            )
    return out


def markdown(res: dict) -> str:
    cfg, cap, summ, rat = res["config"], res["capacity"], summarize(res), res["ratios"]
    ex = {
        m: sorted({r["execution"] for r in res["rows"] if r["mode"] == m and "execution" in r})
        for m in MODES
    }
    runs = ", ".join(f"{LABELS[m]} {'/'.join(e)}" for m, e in ex.items() if e)
    lines = [
        f"# DSA engine: decode throughput vs concurrency under a {_size(res['budget_bytes'])} device KV budget",
        "",
        f"{res['env']['device_name']} ({res['device']}), torch {res['env']['torch']}, {res['env']['when']}, "
        f"commit {res['env']['commit']}. Model: {cfg['model']}; hot buffer {cfg['hot_size']} rows, "
        f"{cfg['row_format']} rows ({cfg['row_bytes']} B), {cfg['key_bytes']}-B index keys, prompt "
        f"{cfg['prompt_len']}, output {cfg['output_len']} tokens.",
        f"Per request on the device: resident {res['per_request_bytes']['resident'] / 2**20:.2f} MiB, "
        f"HiSparse {res['per_request_bytes']['hisparse'] / 2**20:.2f} MiB (hot buffers + index keys), so the "
        f"budget fits **{cap['resident']}** resident and **{cap['hisparse']}** HiSparse requests. Hybrid gets "
        "keys for every request, hot buffers for those the budget cannot hold resident (at least one) "
        "and the rest of the budget as device blocks.",
        f"Decode steps ran: {runs} (graphs = CUDA graph replays).",
        "",
        f"Decode tokens/s over the decode-only steps after the first {UNTIMED_DECODES}, median (min–max) of "
        f"{res['repeats']} runs per point; ratios are of medians against resident at the same concurrency "
        "where it fits (per-repeat range in brackets), against resident's best median beyond.",
        "",
        "| concurrency | resident | always-host | hybrid | hybrid ÷ resident | always-host ÷ resident "
        "| hybrid: blocks, hot buffers, peak spilled | hit rate (host, hybrid) | parity |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for c in sorted({r["concurrency"] for r in res["rows"]}):
        cells = [_cell(summ.get(m, {}).get(c)) if m in res["modes"] else "not run" for m in MODES]
        rr = [_ratio(rat.get(str(c), {}).get(f"{m}/resident")) for m in ("hybrid", "hisparse")]
        ok = [r for r in res["rows"] if r["concurrency"] == c and r["status"] == "ok"]
        hy = [r for r in ok if r["mode"] == "hybrid"]
        split = (
            f"{hy[0]['device_blocks']}, {hy[0].get('hot_slots', c)}, "
            f"{max(r['peak_spilled'] for r in hy)}"
            if hy
            else "-"
        )
        hr = [
            [r["hit_rate"] for r in ok if r["mode"] == m and r["hit_rate"] is not None]
            for m in ("hisparse", "hybrid")
        ]
        hrs = ", ".join(f"{100 * statistics.median(h):.1f} %" if h else "-" for h in hr)
        par = res["parity"].get(str(c))
        ps = "-" if par is None else ("OK" if par else "FAILED")
        lines.append(f"| {c} | {' | '.join(cells)} | {' | '.join(rr)} | {split} | {hrs} | {ps} |")
    fit = [
        v["hybrid/resident"]
        for c, v in rat.items()
        if "hybrid/resident" in v and v["hybrid/resident"]["against"] == "same level"
    ]
    if fit:
        lo = min(x["median"] for x in fit)
        lines += [
            "",
            f"Hybrid ÷ resident where resident fits: {lo:.2f}× at worst (the issue's target: ≥ 0.95×).",
        ]
    steps = {}
    for r in res["rows"]:
        if r["status"] == "ok":
            steps.setdefault((r["mode"], r["concurrency"]), []).append(
                1e3 * r["decode_s"] / r["decode_steps"]
            )
    if steps:
        lines += [
            "",
            "Decode step time, ms (median of the runs; every step decodes all running requests):",
            "",
            "| concurrency | " + " | ".join(LABELS[m] for m in MODES) + " |",
            "|---:|" + "---:|" * len(MODES),
        ]
        for c in sorted({c for _, c in steps}):
            cells = [
                f"{statistics.median(steps[m, c]):.2f}" if (m, c) in steps else "-" for m in MODES
            ]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for p in res.get("profile", []):
        lines += [
            "",
            f"## {LABELS[p['mode']]}, concurrency {p['concurrency']}: {p['steps']} decode steps, "
            f"{p['wall_ms_per_step']:.2f} ms wall per step (under the profiler)"
            + (
                f", {p['device_ms_per_step']:.2f} ms of GPU work" if res["device"] == "cuda" else ""
            ),
            "",
            "```",
            p["table"],
            "```",
        ]
    return "\n".join(lines) + "\n"


def _size(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def _cell(st) -> str:
    return (
        "out of memory"
        if st is None
        else f"{st['median']:,.0f} ({st['min']:,.0f}–{st['max']:,.0f})"
    )


def _ratio(r) -> str:
    if not r:
        return "-"
    if r["per_repeat_min"] is None:
        return f"{r['median']:.2f}×"
    return f"{r['median']:.2f}× ({r['per_repeat_min']:.2f}–{r['per_repeat_max']:.2f})"


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summ = summarize(res)
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    colors = {"resident": "tab:grey", "hisparse": "tab:blue", "hybrid": "tab:green"}
    for mode in MODES:
        pts = sorted(summ.get(mode, {}).items())
        if pts:
            med = [v["median"] for _, v in pts]
            err = [
                [v["median"] - v["min"] for _, v in pts],
                [v["max"] - v["median"] for _, v in pts],
            ]
            ax.errorbar(
                [c for c, _ in pts],
                med,
                yerr=err,
                fmt="o-",
                color=colors[mode],
                capsize=3,
                label=f"{LABELS[mode]} (median, min–max)",
            )
    n_res = res["capacity"]["resident"]
    if n_res:
        ax.axvline(n_res, color="tab:red", lw=0.8, ls=":", label=f"resident's capacity ({n_res})")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="concurrent requests", ylabel="decode tokens/s")
    ax.set_ylim(bottom=0)
    cfg = res["config"]
    ax.set_title(
        f"DSA engine ({cfg['arch']}, {cfg['layers']} layers, prompt {cfg['prompt_len']}), "
        f"{_size(res['budget_bytes'])} KV budget ({res['env']['device_name']})",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(res: dict, stem: str) -> str:
    import json

    res["ratios"] = ratios(res)
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(stem + ".md", "w") as f:
        f.write(md)
    plot(res, stem + ".png")
    return md


def profile_point(ck, args, mode: str, c: int, device, kv: DeviceKV, budget: int, steps=16):
    """torch.profiler over ``steps`` timed decode steps at concurrency c."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof, n, t = profile(activities=acts), [0], []
    first = c + UNTIMED_DECODES  # the prefills, then the untimed decodes

    def hook(fn):
        if n[0] in (first, first + steps):
            torch.cuda.synchronize() if device.type == "cuda" else None
            t.append(time.perf_counter())
            prof.start() if n[0] == first else prof.stop()
        n[0] += 1
        return fn()

    blocks, hot = kv.hybrid_split(c, budget) if mode == "hybrid" else (None, None)
    gen.generate(
        ck,
        mode,
        args.row_format,
        device,
        prompts(ck, c, args.prompt_len),
        UNTIMED_DECODES + steps + 2,
        args.hot_size,
        device_blocks=blocks,
        hot_slots=hot,
        prefill_first=True,
        graphs=False if args.eager else None,
        step_hook=hook,
    )
    ka = prof.key_averages()
    dev = sum(getattr(e, "self_device_time_total", 0) for e in ka)
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return dict(
        mode=mode,
        concurrency=c,
        steps=steps,
        wall_ms_per_step=1e3 * (t[1] - t[0]) / steps,
        device_ms_per_step=dev / 1e3 / steps,
        table=ka.table(sort_by=sort, row_limit=18, max_name_column_width=48),
    )


def parse(argv):
    from hisparse.cli.demo_model import add_checkpoint_flags

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--small", action="store_true", help="the small CPU-sized configuration")
    add_checkpoint_flags(ap)  # hisparse demo's: --model DIR, or the generated checkpoint's shape
    ap.add_argument("--row-format", choices=("fp8", "bf16", "f32"), default="fp8")
    ap.add_argument("--hot-size", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--budget-gib", type=float, default=None, help="device KV budget (GiB)")
    ap.add_argument(
        "--concurrency",
        default=None,
        help="comma-separated levels (default: a fixed set plus both capacities)",
    )
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {MODES}")
    ap.add_argument("--repeats", type=int, default=3, help="runs per point (default 3)")
    ap.add_argument(
        "--max-seconds", type=float, default=None, help="start no new level after this many seconds"
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="MODE:C,...",
        help="after the sweep, profile decode steps of these points",
    )
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument(
        "--commit", help="the tree's commit for the report (default: git's HEAD, stale in a copy)"
    )
    ap.add_argument(
        "--name", default=None, help="output file stem (default engine_concurrency[_small])"
    )
    ap.add_argument("--threads", type=int, default=1, help="CPU torch threads (default 1)")
    ap.add_argument("--no-parity", dest="parity", action="store_false")
    ap.add_argument(
        "--eager",
        action="store_true",
        help="no CUDA graphs in any mode",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU visible (use --device cpu --small)")
    args.small = args.small or args.device == "cpu"
    given = args.concurrency
    for k, v in (SMALL if args.small else GPU).items():
        if getattr(args, k) is None and not (args.model and k in ("top_k", "hot_size")):
            setattr(args, k, v)
    args.levels = tuple(int(x) for x in given.split(",")) if given else ()
    args.modes = [m for m in MODES if m in args.modes.split(",")]
    args.profile = [
        (m, int(c)) for m, _, c in (x.partition(":") for x in (args.profile or "").split(",") if x)
    ]
    if (
        not args.modes
        or args.repeats < 1
        or args.budget_gib <= 0
        or any(c < 1 for c in args.levels)
    ):
        ap.error(f"need a subset of {MODES}, --repeats >= 1, --budget-gib > 0, levels >= 1")
    if args.output_len <= UNTIMED_DECODES + 1 or any(m not in MODES for m, _ in args.profile):
        ap.error(
            f"need --output-len > {UNTIMED_DECODES + 1} and --profile items MODE:C, MODE in {MODES}"
        )
    return args


def setup(ck, choice, args, device) -> dict:
    """The run's record before any point: model, budget, capacities, environment."""
    from hisparse.ops.limits import default_hot_size

    args.hot_size = args.hot_size or default_hot_size(ck.cfg.index_topk)
    kv = DeviceKV.of(
        ck.cfg, args.row_format, context_rows(args.prompt_len + args.output_len), args.hot_size
    )
    budget = int(args.budget_gib * 2**30)
    name = (
        torch.cuda.get_device_name(0)
        if device.type == "cuda"
        else platform.processor() or platform.machine()
    )
    config = dict(
        model=choice.describe(),
        checkpoint=choice.to_dict(),
        arch=ck.cfg.arch,
        layers=kv.layers,
        full_layers=kv.full_layers,
        top_k=ck.cfg.index_topk,
        hot_size=args.hot_size,
        row_format=args.row_format,
        row_bytes=kv.row_bytes,
        key_bytes=kv.key_bytes,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        context=kv.context,
    )
    return (
        dict(
            engine="hisparse.engine.dsa",
            device=args.device,
            budget_gib=args.budget_gib,
            budget_bytes=budget,
            config=config,
            per_request_bytes={m: kv.total(m, 1) for m in ("resident", "hisparse")},
            capacity={m: kv.capacity(m, budget) for m in MODES},
            repeats=args.repeats,
            modes=args.modes,
            untimed_decodes=UNTIMED_DECODES,
            rows=[],
            parity={},
            profile=[],
            env=dict(
                torch=torch.__version__,
                device_name=name,
                threads=torch.get_num_threads(),
                commit=args.commit or _git_commit(),
                when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            ),
        ),
        kv,
        budget,
    )


def level(ck, args, device, kv, budget, res, c: int) -> None:
    """Every mode at concurrency c, --repeats times interleaved; parity against the first run."""
    fits = {m: c <= res["capacity"][m] for m in args.modes}
    for m in args.modes:
        if not fits[m]:
            res["rows"].append(
                dict(mode=m, concurrency=c, status="out of memory", decode_tokens_per_s=None)
            )
            print(f"  c={c:4d} {m:<8}: out of memory", flush=True)
    ref, ok = None, True
    for rep in range(args.repeats):
        for m in (m for m in args.modes if fits[m]):
            row, tokens = run_point(ck, args, m, c, device, kv, budget)
            row["repeat"] = rep
            res["rows"].append(row)
            ref = tokens if ref is None else ref
            if args.parity and tokens != ref:
                ok = False
                print(f"  c={c} {m} repeat {rep}: PARITY FAILED", flush=True)
            hr = "" if row["hit_rate"] is None else f", hit rate {100 * row['hit_rate']:.1f} %"
            hy = (
                f", {row['device_blocks']} blocks, peak {row['peak_spilled']} spilled"
                if m == "hybrid"
                else ""
            )
            print(
                f"  c={c:4d} {m:<8} #{rep}: {row['decode_tokens_per_s']:10,.0f} decode tok/s "
                f"({row['execution']}, {row['wall_s']:.1f} s{hr}{hy})",
                flush=True,
            )
    if args.parity and sum(fits.values()) >= 2:
        res["parity"][str(c)] = ok


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    ck, choice = load_model(args, device)
    res, kv, budget = setup(ck, choice, args, device)
    cap, per = res["capacity"], res["per_request_bytes"]
    print(
        f"budget {_size(budget)}: resident fits {cap['resident']} requests ({per['resident'] / 2**20:.2f} MiB "
        f"each), HiSparse {cap['hisparse']} ({per['hisparse'] / 2**20:.2f} MiB each)",
        flush=True,
    )
    for m in args.modes:  # warm-up (kernels compiled, allocator, cuBLAS) outside the measurements
        gen.generate(
            ck,
            m,
            args.row_format,
            device,
            prompts(ck, 2, 2 * ck.cfg.index_topk),
            UNTIMED_DECODES + 2,
            args.hot_size,
            device_blocks=64 if m == "hybrid" else None,
            prefill_first=True,
            graphs=False if args.eager else None,
        )
    extra = set() if args.levels else {cap[m] for m in ("resident", "hisparse") if cap[m] > 0}
    # the capacities (the headline points) first, so that --max-seconds drops the others
    levels = sorted(extra, reverse=True) + sorted(set(args.levels or args.concurrency) - extra)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(
        args.out_dir,
        args.name or ("engine_concurrency_small" if args.small else "engine_concurrency"),
    )
    t_all, md = time.perf_counter(), ""
    for c in levels:
        if args.max_seconds is not None and time.perf_counter() - t_all > args.max_seconds:
            print(f"  c={c}: skipped (--max-seconds {args.max_seconds:g} reached)", flush=True)
            res.setdefault("skipped_levels", []).append(c)
            continue
        level(ck, args, device, kv, budget, res, c)
        res["total_s"] = time.perf_counter() - t_all
        md = write(res, stem)  # after every level: a cut-short run still leaves its results
    for m, c in args.profile:
        if c > cap[m]:
            print(f"  profile c={c} {m}: does not fit the budget, skipped", flush=True)
            continue
        res["profile"].append(profile_point(ck, args, m, c, device, kv, budget))
        md = write(res, stem)
    print("\n" + md)
    print(f"wrote {stem}.json, .md, .png ({res.get('total_s', 0):.0f} s)")
    ratios_ok = all(math.isfinite(v["median"]) for r in res["ratios"].values() for v in r.values())
    return 0 if res["rows"] and all(res["parity"].values()) and ratios_ok else 1


if __name__ == "__main__":
    sys.exit(main())
