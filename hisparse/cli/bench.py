"""`hisparse bench`: op micro-benchmarks, then hit rate against hot-buffer size: the DSA engine
(hisparse.engine.dsa) in HiSparse mode on `demo`'s workload, once per hot size, whose generated
tokens must not change with it. The op part runs the repository's ``benchmarks/bench_ops.py``
in a source checkout and a small built-in subset in an installed package (which has no
benchmarks/); the screen says which one ran, then its table."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import time
from pathlib import Path
from typing import List

import torch

from hisparse.cli import demo_model, workload
from hisparse.cli.demo_report import run_stats, tokens_digest
from hisparse.cli.errors import CommandError

#: hisparse/cli/bench.py -> the repository root, where a source checkout (editable install
#: included) keeps benchmarks/; an installed package sits in site-packages with none beside it.
BENCH_OPS = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_ops.py"
BUILTIN = "built-in subset"


def _load_bench_ops(path: Path):
    """The checkout's bench_ops module, or None where there is none. A bench_ops.py that is there
    but does not load is an error: falling back would hide it behind the subset's figures."""
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("hisparse_bench_ops", path)
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        raise CommandError(f"{path} does not load: {type(e).__name__}: {e}") from e
    missing = [n for n in ("bench_resolve", "bench_gather", "alloc_pool") if not hasattr(mod, n)]
    if missing:
        raise CommandError(f"{path} lacks {', '.join(missing)}")
    return mod


def _builtin_ops(device: str, reps: int) -> list:
    """resolve + gather at top-k 2048 / hot 4096, a drifting trace with ~5 % misses."""
    K, H, rb = 2048, 4096, 656
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    for B in (1, 8):
        rt, gt, misses = _time_resolve_gather(device, B, K, H, rb, reps, g)
        rows.append(
            dict(
                op="resolve",
                device=device,
                batch=B,
                top_k=K,
                hot=H,
                miss_rate=0.05,
                median_us=statistics.median(rt),
            )
        )
        med = statistics.median(gt)
        rows.append(
            dict(
                op="gather",
                device=device,
                batch=B,
                row_bytes=rb,
                miss_rate=0.05,
                rows=misses // reps,
                median_us=med,
                gbps=misses // reps * rb / (med * 1e-6) / 1e9,
            )
        )
    return rows


def _time_resolve_gather(device: str, B: int, K: int, H: int, rb: int, reps: int, g) -> tuple:
    """(resolve µs, gather µs, misses) over ``reps`` steps after two warm-up steps."""
    from hisparse import ops

    keys = 1 << 20
    slot_keys = torch.full((B, H), -1, dtype=torch.int32, device=device)
    lru = torch.arange(H, dtype=torch.int16, device=device).repeat(B, 1)
    stats = torch.zeros(2, dtype=torch.uint64, device=device)
    state = torch.arange(B, dtype=torch.int32, device=device)
    out = torch.empty(B, K, dtype=torch.int32, device=device)
    src, dst = torch.empty_like(out), torch.empty_like(out)
    cnt = torch.empty(B, dtype=torch.int32, device=device)
    cur = torch.randint(0, keys, (B, K), generator=g, device=device, dtype=torch.int32)
    host = [torch.zeros(keys, rb, dtype=torch.uint8, device="cpu" if device == "cpu" else device)]
    hot = [torch.zeros(B * H, rb, dtype=torch.uint8, device=device)]
    rt, gt, misses = [], [], 0
    for i in range(reps + 2):
        mask = torch.rand(B, K, generator=g, device=device) < 0.05
        cur = torch.where(
            mask,
            torch.randint(0, keys, (B, K), generator=g, device=device, dtype=torch.int32),
            cur,
        )
        t0 = time.perf_counter()
        ops.resolve_residency(cur, state, slot_keys, lru, stats, out, src, dst, cnt, num_keys=keys)
        if device == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        ops.gather(host, hot, src, dst, cnt)
        if device == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 2:
            rt.append((t1 - t0) * 1e6)
            gt.append((t2 - t1) * 1e6)
            misses += int(cnt.sum())
    return rt, gt, misses


def op_benchmarks(device: str, reps: int) -> dict:
    path = BENCH_OPS  # read at call time, so a test can stand in for an installed package
    mod = _load_bench_ops(path)
    if mod is None:
        print(
            f"op micro-benchmarks ({device}): the {BUILTIN} (resolve and gather at batch 1 and 8, "
            "5 % misses); the full set, benchmarks/bench_ops.py, comes with a source checkout",
            flush=True,
        )
        return {"source": BUILTIN, "rows": _builtin_ops(device, reps)}
    print(f"op micro-benchmarks ({device}): {path}", flush=True)
    timer = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        timer = mod.CudaTimer(max(2 * props.L2_cache_size, 64 << 20))
    batches = (1, 8, 64) if device == "cuda" else (1, 8)
    rows = list(mod.bench_resolve(device, batches, reps, timer))
    pool_gib = 1.0 if device == "cuda" else 0.0625
    pool = mod.alloc_pool(int(pool_gib * (1 << 30)), device)
    rows += mod.bench_gather(device, [(pool_gib, pool)], batches, reps, timer, single=False)
    return {"source": "benchmarks/bench_ops.py", "rows": rows}


def ops_table(rows: list) -> List[str]:
    """One line per op configuration: median time, and bandwidth for the gathers."""
    out = [f"{'op':<8} {'batch':>5} {'misses':>7} {'row B':>6} {'median us':>10} {'GB/s':>6}"]
    for r in rows:
        gbps = r.get("gbps")
        out.append(
            f"{r['op']:<8} {r['batch']:>5} {100 * r['miss_rate']:>6.1f}% "
            f"{r.get('row_bytes', '-'):>6} {r['median_us']:>10.1f} "
            + (f"{gbps:>6.1f}" if gbps is not None else f"{'-':>6}")
        )
    return out


def hot_size_sweep(ck, p: workload.Plan, prompts, progress: bool = True) -> list:
    """The workload in HiSparse mode once per hot size of ``p``: the connector's counters."""
    from hisparse.engine.dsa.generate import generate

    out = []
    k = p.model.cfg.index_topk
    for H in p.hot_sizes:
        g = generate(
            ck, "hisparse", p.row_format, torch.device(p.device), prompts, p.new_tokens, H,
            max_batch=p.batch,
        )  # fmt: skip
        s = run_stats(g)
        out.append(
            dict(
                hot_size=H,
                hot_over_top_k=H / k,
                **{key: s[key] for key in SWEPT},
                h2d_bytes_per_token=s["host_to_device_bytes"] / max(1, s["generated_tokens"]),
                tokens_sha256=tokens_digest(g.tokens),
            )
        )
        if progress:
            print(
                f"  hot={H:6d} ({H / k:4.2f} x top-k): hit rate {100 * s['hit_rate']:5.1f} %  "
                f"misses {s['misses']:8d}  H2D {s['host_to_device_bytes'] / 2**20:8.2f} MiB  "
                f"({g.seconds:.1f} s)",
                flush=True,
            )
    return out


#: The run figures (demo_report.run_stats) each sweep point keeps.
SWEPT = ("hit_rate", "hits", "misses", "host_to_device_bytes", "device_kv_bytes", "tokens_per_s")


def sweep_table(sweep: list) -> List[str]:
    out = [
        f"{'hot rows':>9} {'x top-k':>8} {'hit rate':>9} {'misses':>9} "
        f"{'H2D/token':>11} {'device KV':>11}"
    ]
    for r in sweep:
        out.append(
            f"{r['hot_size']:>9} {r['hot_over_top_k']:>8.2f} {100 * r['hit_rate']:>8.1f}% "
            f"{r['misses']:>9} {r['h2d_bytes_per_token'] / 1024:>7.1f} KiB "
            f"{r['device_kv_bytes'] / 2**20:>7.2f} MiB"
        )
    return out


def plot_sweep(sweep: list, p: workload.Plan, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = p.model.cfg.index_topk
    x = [r["hot_size"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ax.plot(x, [100 * r["hit_rate"] for r in sweep], "o-", color="tab:blue", label="hit rate")
    ax.set_xlabel(f"hot-buffer rows per request per layer (top-k = {k})")
    ax.set_ylabel("hit rate (%)", color="tab:blue")
    ax.set_ylim(0, 100)
    ax.axvline(k, color="grey", lw=0.8, ls=":")
    ax2 = ax.twinx()
    ax2.plot(
        x,
        [r["h2d_bytes_per_token"] / 1024 for r in sweep],
        "s--",
        color="tab:red",
        label="host->device KiB / token",
    )
    ax2.set_ylabel("host->device KiB per generated token", color="tab:red")
    ax2.set_ylim(bottom=0)
    ax.set_title(f"HiSparse hit rate vs hot-buffer size ({p.row_format} rows)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(args, p: workload.Plan) -> int:
    prev = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = {"device": p.device, "workload": p.to_dict()}
        if not args.skip_ops:
            result["ops"] = op_benchmarks(p.device, args.op_reps)
            print("\n".join(["", *ops_table(result["ops"]["rows"]), ""]), flush=True)
        print(
            f"hit rate vs hot-buffer size (DSA engine, HiSparse mode)\nmodel: {p.model.describe()}"
        )
        print(p.describe(), flush=True)
        ck = demo_model.load(p.model, torch.device(p.device))
        result["sweep"] = hot_size_sweep(ck, p, workload.prompts(ck, p), args.progress)
    finally:
        torch.set_num_threads(prev)
    print("\n".join(["", *sweep_table(result["sweep"])]))
    same = len({r["tokens_sha256"] for r in result["sweep"]}) <= 1
    result["tokens_identical"] = same
    print(
        "generated tokens: identical at every hot size"
        if same
        else "FAILED: the generated tokens differ between hot sizes (they must not depend on it)"
    )
    if args.plot:
        plot_sweep(result["sweep"], p, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results written to {args.json}")
    return 0 if same else 1
