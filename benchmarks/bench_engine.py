"""The headline: decode tokens/s against concurrency under one fixed GPU KV budget, resident vs
HiSparse, on the reference engine, up to well past the point where resident runs out of memory.

    # H200 (about 4 minutes):
    python benchmarks/bench_engine.py --device cuda
    # CPU, small mode (CI-sized, about a minute on 2 cores):
    python benchmarks/bench_engine.py --device cpu --small

Method. One engine configuration; the GPU KV budget pays, per running request, for everything
the engine keeps on the device for it: resident = every KV row of its context in every layer +
its indexer keys; HiSparse = a hot buffer of `hot_size` rows and a device window of
`recent_window` rows per layer + its indexer keys (the full KV sits in the pinned host pool). The
budget therefore fits `n_res` resident and `n_hs` HiSparse requests. At each concurrency c all c
requests are admitted together (prefill), then decode to the end; decode tokens/s is measured over
the decode-only steps (a device sync only where they start and end). Resident beyond `n_res` does
not fit: the point is reported as out of memory, and a server would stay at its `n_res` plateau
(drawn dashed). Where both modes ran, their tokens are compared (bit-exact parity).
Writes benchmarks/results/<name>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hisparse.engine import EngineConfig, compare_runs, run_workload  # noqa: E402

GPU_DEFAULTS = dict(num_layers=8, index_share=2, hidden=64, indexer_dim=16, top_k=512, hot_size=1024,
                    prompt_len=8192, output_len=128, recent_window=8, drift=0.05,
                    metrics_interval=2000, length_jitter=0.0)
GPU_BUDGET_GIB = 2.0
GPU_CONCURRENCY = (1, 4, 16, 32, 64, 128, 256)
SMALL_DEFAULTS = dict(num_layers=4, index_share=2, hidden=32, indexer_dim=16, top_k=32, hot_size=64,
                      prompt_len=256, output_len=32, recent_window=8, drift=0.05,
                      metrics_interval=2000, length_jitter=0.0)
SMALL_BUDGET_GIB = 4.0 / 1024
SMALL_CONCURRENCY = (1, 2, 4, 8, 16)


def _git_commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def per_request_device_bytes(cfg: EngineConfig, mode: str) -> int:
    """Device bytes the engine allocates per state row (= per running request)."""
    idx = cfg.max_context * cfg.num_groups * cfg.indexer_dim * (8 if cfg.dtype == "float64" else 4)
    if mode == "resident":
        return cfg.max_context * cfg.num_layers * cfg.row_bytes + idx
    window = max(1, cfg.recent_window)
    return cfg.num_layers * (cfg.hot_size + window) * cfg.row_bytes + idx


def run_point(cfg: EngineConfig, mode: str, c: int, device: str):
    c_cfg = cfg.replace(num_requests=c, max_running=c)
    r = run_workload(c_cfg, mode=mode, device=device)
    s = r.stats
    used = s.device_kv_bytes + s.indexer_bytes
    assert used == c * per_request_device_bytes(cfg, mode), (used, c, mode)
    row = dict(mode=mode, concurrency=c, status="ok", decode_tokens_per_s=s.decode_tokens_per_s,
               tokens_per_s=s.tokens_per_s, wall_s=s.wall_s, device_bytes=used,
               hit_rate=s.hit_rate if mode == "hisparse" else None,
               h2d_bytes=s.host_to_device_bytes, host_pool_bytes=s.host_pool_bytes,
               topk_overlap=s.topk_overlap, generated_tokens=s.generated_tokens)
    return row, r


def markdown(res: dict) -> str:
    cfg = res["config"]
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
        f"**{res['capacity']['resident']}** resident and **{res['capacity']['hisparse']}** HiSparse requests.",
        "",
        "| concurrency | resident decode tok/s | HiSparse decode tok/s | HiSparse hit rate | parity |",
        "|---:|---:|---:|---:|:---:|",
    ]
    by = {}
    for row in res["rows"]:
        by.setdefault(row["concurrency"], {})[row["mode"]] = row
    for c in sorted(by):
        r, h = by[c].get("resident"), by[c].get("hisparse")
        rs = f"{r['decode_tokens_per_s']:,.0f}" if r and r["status"] == "ok" else "out of memory"
        hs = f"{h['decode_tokens_per_s']:,.0f}" if h and h["status"] == "ok" else "out of memory"
        hr = f"{100 * h['hit_rate']:.1f} %" if h and h["status"] == "ok" else "-"
        par = res["parity"].get(str(c))
        ps = "-" if par is None else ("OK" if par else "FAILED")
        lines.append(f"| {c} | {rs} | {hs} | {hr} | {ps} |")
    best_r = max((x["decode_tokens_per_s"] for x in res["rows"] if x["mode"] == "resident" and x["status"] == "ok"), default=0)
    best_h = max((x["decode_tokens_per_s"] for x in res["rows"] if x["mode"] == "hisparse" and x["status"] == "ok"), default=0)
    if best_r:
        lines += ["", f"Best decode throughput: resident {best_r:,.0f} tok/s, HiSparse {best_h:,.0f} tok/s "
                      f"(**{best_h / best_r:.2f}x**)."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for mode, color, label in (("resident", "tab:grey", "all KV on the device"),
                               ("hisparse", "tab:blue", "HiSparse (host pool + hot buffers)")):
        pts = [(x["concurrency"], x["decode_tokens_per_s"]) for x in res["rows"]
               if x["mode"] == mode and x["status"] == "ok"]
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=label)
    n_res = res["capacity"]["resident"]
    plateau = [x["decode_tokens_per_s"] for x in res["rows"]
               if x["mode"] == "resident" and x["status"] == "ok" and x["concurrency"] == n_res]
    cs = sorted({x["concurrency"] for x in res["rows"]})
    if plateau and cs and cs[-1] > n_res:
        ax.plot([n_res, cs[-1]], [plateau[0]] * 2, "--", color="tab:grey", lw=1,
                label=f"resident capped at {n_res} running (KV budget)")
    if n_res:
        ax.axvline(n_res, color="tab:red", lw=0.8, ls=":")
        ax.text(n_res, ax.get_ylim()[1] * 0.95, f" resident out of memory\n beyond {n_res}",
                color="tab:red", fontsize=8, va="top")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Reference engine, {res['budget_gib']:g} GiB device KV budget "
                 f"({res['env']['device_name']})", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--small", action="store_true", help="the small CPU-sized configuration")
    ap.add_argument("--budget-gib", type=float, default=None, help="device KV budget (GiB)")
    ap.add_argument("--concurrency", default=None, help="comma-separated concurrency levels")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--hot-size", type=int, default=None)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--name", default=None, help="output file stem (default engine_concurrency[_small])")
    ap.add_argument("--threads", type=int, default=1, help="CPU torch threads (default 1)")
    ap.add_argument("--no-parity", dest="parity", action="store_false")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU visible (use --device cpu --small)")
    small = args.small or args.device == "cpu"
    base = dict(SMALL_DEFAULTS if small else GPU_DEFAULTS)
    for flag, key in (("prompt_len", "prompt_len"), ("output_len", "output_len"),
                      ("top_k", "top_k"), ("hot_size", "hot_size")):
        v = getattr(args, flag)
        if v is not None:
            base[key] = v
    budget_gib = args.budget_gib if args.budget_gib is not None else (SMALL_BUDGET_GIB if small else GPU_BUDGET_GIB)
    if budget_gib <= 0:
        ap.error("--budget-gib must be > 0")
    levels = (tuple(int(x) for x in args.concurrency.split(",")) if args.concurrency
              else (SMALL_CONCURRENCY if small else GPU_CONCURRENCY))
    if any(c < 1 for c in levels):
        ap.error("--concurrency levels must be >= 1")
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
    res = dict(device=args.device, budget_gib=budget_gib, config=cfg.to_dict(), row_bytes=cfg.row_bytes,
               per_request_bytes=per, capacity=cap, rows=[], parity={},
               env=dict(torch=torch.__version__, device_name=dev_name, threads=torch.get_num_threads(),
                        commit=_git_commit(),
                        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    print(f"budget {budget_gib:g} GiB: resident fits {cap['resident']} requests "
          f"({per['resident'] / 2**20:.2f} MiB each), HiSparse {cap['hisparse']} "
          f"({per['hisparse'] / 2**20:.2f} MiB each)", flush=True)
    # warm-up (CUDA context, kernels, allocator) outside the measurements
    for mode in ("resident", "hisparse"):
        run_workload(cfg.replace(prompt_len=min(cfg.prompt_len, 64), output_len=4), mode=mode, device=args.device)
    extra = {cap[m] for m in cap if 0 < cap[m]} if not args.concurrency else set()
    levels = sorted(set(levels) | extra)
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, name)
    t_all = time.perf_counter()
    md = ""
    for c in levels:
        runs = {}
        for mode in ("resident", "hisparse"):
            if c > cap[mode]:
                res["rows"].append(dict(mode=mode, concurrency=c, status="out of memory",
                                        decode_tokens_per_s=None, device_bytes=c * per[mode]))
                print(f"  c={c:4d} {mode:<8}: out of memory ({c * per[mode] / 2**30:.2f} GiB > budget)", flush=True)
                continue
            row, r = run_point(cfg, mode, c, args.device)
            res["rows"].append(row)
            runs[mode] = r
            hr = f", hit rate {100 * row['hit_rate']:.1f} %" if row["hit_rate"] is not None else ""
            print(f"  c={c:4d} {mode:<8}: {row['decode_tokens_per_s']:10,.0f} decode tok/s "
                  f"({row['wall_s']:.1f} s{hr})", flush=True)
        if args.parity and len(runs) == 2:
            ok = compare_runs(runs["resident"], runs["hisparse"]).ok
            res["parity"][str(c)] = ok
            if not ok:
                print(f"  c={c}: PARITY FAILED", flush=True)
        del runs
        res["total_s"] = time.perf_counter() - t_all
        md = write(res, stem)  # after every level: a cut-short run still leaves its results
    print()
    print(md)
    print(f"wrote {stem}.json, .md, .png ({res['total_s']:.0f} s)")
    return 0 if all(res["parity"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
