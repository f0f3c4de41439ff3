"""Diagnosis of the parity flips at batch >= 64 (engine_tpot_h200.md): are the hot rows right?

    python benchmarks/check_hot_rows.py --batch 64 --steps 30

Replays resident and each HiSparse variant of hisparse.engine.graph in lockstep (one replay
each per step, the same staged drift) and after each step compares tokens and hidden states with
resident's. Every `--every` steps, and at the first divergence, it checks the residency invariant
of every index group: each hot slot that names a key holds exactly that key's host row. A
divergence with the invariant intact points at the math (a reduction order that changed), one
with it broken at the data plane.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from hisparse.engine.graph import DecodeStep, Drift, GraphConfig, GraphStep, KVStore, Weights


def stale_rows(step: DecodeStep) -> int:
    """Hot slots whose bytes differ from their key's host row, over every group of the step."""
    bad = 0
    for p in step.parts:
        for layer, rt in enumerate(p.runtimes if p.host else ()):
            g = rt.index_group
            keys = g.slot_keys.reshape(-1)
            rows = g.hot_base + torch.arange(keys.numel(), device=keys.device)
            have = keys >= 0
            hot = step.hot[layer][rows[have]]
            want = rt.host_view[keys[have].long().cpu()].to(hot.device)
            bad += int((hot != want).any(dim=1).sum())
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = GraphConfig.deepseek_v32(layers=args.layers)
    w = Weights(cfg, "cuda")
    kv = KVStore(cfg, args.batch, "cuda")
    variants = {
        "resident": dict(mode="resident"),
        "hisparse": dict(mode="hisparse"),
        "hisparse_serial": dict(mode="hisparse", overlap=False),
        "hisparse_in_read": dict(mode="hisparse", misses="in_read"),
        "hisparse_beside": dict(mode="hisparse", misses="beside"),
    }
    graphs = {}
    for name, kw in variants.items():
        mode = kw.pop("mode")
        step = DecodeStep(cfg, w, kv, mode, args.batch, **kw)
        drift = Drift(kv.max_batch, cfg.ctx_len, cfg.top_k, 0.05, "cuda", seed=11)
        graphs[name] = GraphStep(step, drift, warmup=2)
    report = {n: dict(first_divergence=None, stale_rows={}) for n in graphs if n != "resident"}
    ref = graphs["resident"].step
    for i in range(args.steps):
        for gs in graphs.values():
            gs.stage_next()
            gs.replay()
        torch.cuda.synchronize()
        for name, r in report.items():
            step = graphs[name].step
            same = torch.equal(step.tokens, ref.tokens) and torch.equal(step.hidden, ref.hidden)
            first = not same and r["first_divergence"] is None
            if first:
                r["first_divergence"] = i
            if first or i % args.every == args.every - 1:
                r["stale_rows"][i] = stale_rows(step)
    for name, r in report.items():
        print(f"{name}: first divergence at step {r['first_divergence']}; "
              f"stale hot rows by step {r['stale_rows']}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(batch=args.batch, layers=args.layers, report=report), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
