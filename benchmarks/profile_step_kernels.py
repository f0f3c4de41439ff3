"""Where a decode step's GPU time goes, by kernel (torch.profiler over eager steps of
hisparse.engine.graph), per mode and batch: the per-request cost that bounds throughput at
HiSparse's capacity.

    python benchmarks/profile_step_kernels.py --out benchmarks/results/step_kernels_h200.md
"""

from __future__ import annotations

import argparse
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from hisparse.engine.graph import DecodeStep, Drift, GraphConfig, KVStore, Weights


def kernel_table(step: DecodeStep, drift: Drift, steps: int) -> tuple:
    for _ in range(2):
        drift.advance()
        step.stage(drift.bias)
        step.forward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            drift.advance()
            step.stage(drift.bias)
            step.forward()
        torch.cuda.synchronize()
    us = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us[e.name[:90]] += e.device_time / steps
    return us, sum(us.values())


def added_vs_resident(tables: dict, batch: int, layers: int) -> list:
    """Per mode, the kernels whose time differs from resident's by over 1 us per step, per
    layer: where a mode's added time goes."""
    if "resident" not in tables:
        return []
    lines = []
    base = tables["resident"]
    for mode, us in tables.items():
        if mode == "resident":
            continue
        diff = {k: us.get(k, 0.0) - base.get(k, 0.0) for k in set(us) | set(base)}
        total = sum(diff.values()) / layers
        lines += [f"## batch {batch}, {mode} minus resident: {total:.1f} us per layer", ""]
        lines += ["| kernel | us/layer |", "|---|---:|"]
        for name, t in sorted(diff.items(), key=lambda kv: -abs(kv[1])):
            if abs(t) > 1.0:
                lines.append(f"| `{name.replace('|', '/')}` | {t / layers:+.1f} |")
        lines.append("")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="30,112")
    ap.add_argument(
        "--modes",
        default="resident,hisparse",
        help="of resident, hisparse, hisparse_in_read, hisparse_beside",
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--attention", choices=("bmm", "fused"), default="bmm")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = GraphConfig.deepseek_v32(layers=args.layers)
    batches = [int(b) for b in args.batches.split(",")]
    w = Weights(cfg, "cuda")
    kv = KVStore(cfg, max(batches), "cuda")
    lines = [
        f"# GPU time per decode step by kernel ({torch.cuda.get_device_name()}, "
        f"{cfg.layers} layers, eager steps, us per step)",
        "",
    ]
    for b in batches:
        tables = {}
        for mode in args.modes.split(","):
            base, _, path = mode.partition("_")  # hisparse_in_read -> hisparse, misses="in_read"
            step = DecodeStep(cfg, w, kv, base, b, misses=path or "op", attention=args.attention)
            drift = Drift(kv.max_batch, cfg.ctx_len, cfg.top_k, 0.05, "cuda", seed=11)
            us, total = kernel_table(step, drift, args.steps)
            tables[mode] = us
            lines += [f"## batch {b}, {mode}: {total:.0f} us of kernels per step", ""]
            lines += ["| kernel | us/step | share |", "|---|---:|---:|"]
            for name, t in us.most_common(args.top):
                name = name.replace("|", "/")
                lines.append(f"| `{name}` | {t:.0f} | {t / total:.1%} |")
            lines.append("")
            del step
            torch.cuda.empty_cache()
        lines += added_vs_resident(tables, b, cfg.layers)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
