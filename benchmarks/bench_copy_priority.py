"""Can the misses' copy run beside the decode step instead of in front of it? Stream priority and
the copy's grid, measured inside the captured step (hisparse.engine.graph).

    python benchmarks/bench_copy_priority.py --json benchmarks/results/copy_priority_h200.json

The op's gather launches every SM times its occupancy; its warps then sit on PCIe reads, so the
step's own kernels queue behind it (bench_gather_overlap.py). A copy of a few CTAs leaves the
SMs free but, launched on an ordinary stream, waits for SM slots behind the step's kernels
(engine_tpot_h200.md: 12x slower). Here each variant puts the copy on a stream of the highest
priority (the block scheduler then places its CTAs first as SMs free up), with the op's grid or
a capped grid (benchmarks/capped_gather.py), unsplit and split in two halves. Graphs are
replayed by torch and, where torch keeps the captured graph, also instantiated with
cudaGraphInstantiateFlagUseNodePriority (so the nodes keep their stream's priority whatever
torch's own flags are). Per variant: ms per step (median of the rounds' medians, modes
interleaved), added us per layer over resident, bit-identity with resident after the rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys

import torch
from capped_gather import cap_gathers

from hisparse.engine.graph import (
    DecodeStep,
    Drift,
    GraphConfig,
    GraphStep,
    KVStore,
    Weights,
)

USE_NODE_PRIORITY = 8  # cudaGraphInstantiateFlagUseNodePriority


def _cudart():
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


class NodePriorityGraph:
    """The step captured by torch (keep_graph) and instantiated by us with node priorities."""

    def __init__(self, gs: GraphStep, lib) -> None:
        self.gs, self.lib = gs, lib
        raw = gs.graph.raw_cuda_graph()
        self.exec = ctypes.c_void_p()
        rc = lib.cudaGraphInstantiateWithFlags(
            ctypes.byref(self.exec), ctypes.c_void_p(raw), ctypes.c_ulonglong(USE_NODE_PRIORITY)
        )
        if rc != 0:
            raise RuntimeError(f"cudaGraphInstantiateWithFlags returned {rc}")

    def replay(self) -> None:
        s = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        rc = self.lib.cudaGraphLaunch(self.exec, s)
        if rc != 0:
            raise RuntimeError(f"cudaGraphLaunch returned {rc}")


def _prioritise(step: DecodeStep) -> None:
    _, high = torch.cuda.Stream.priority_range()
    for p in step.parts:
        for rt in p.runtimes if p.host else ():
            g = rt.index_group
            if not getattr(g, "_prio", False):
                g.copy_stream = torch.cuda.Stream(device=step.kv.device, priority=high)
                g._prio = True


VARIANTS = (
    # name, split, priority, capped blocks (0: the op's grid), node-priority instantiation
    ("resident", 1, False, 0, False),
    ("hisparse", 1, False, 0, False),
    ("hisparse_prio", 1, True, 0, False),
    ("capped16", 1, False, 16, False),
    ("capped16_prio", 1, True, 16, False),
    ("capped8_prio", 1, True, 8, False),
    ("capped32_prio", 1, True, 32, False),
    ("split_prio", 2, True, 0, False),
    ("split_capped16_prio", 2, True, 16, False),
    ("hisparse_prio_np", 1, True, 0, True),
    ("capped16_prio_np", 1, True, 16, True),
    ("split_capped16_prio_np", 2, True, 16, True),
)


def timed(replay, gs: GraphStep, n: int) -> list:
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(n)]
    for a, b in ev:
        gs.stage_next()
        a.record()
        replay()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def run_batch(cfg, w, kv, batch, args, lib) -> dict:
    graphs = {}
    for name, split, prio, blocks, np_ in VARIANTS:
        if np_ and lib is None:
            continue
        mode = "resident" if name == "resident" else "hisparse"
        step = DecodeStep(cfg, w, kv, mode, batch, split=split)
        if prio:
            _prioritise(step)
        if blocks:
            cap_gathers(step, blocks)
        drift = Drift(kv.max_batch, cfg.ctx_len, cfg.top_k, args.miss, "cuda", seed=11)
        try:
            gs = GraphStep(step, drift, warmup=2, keep_graph=np_)
            replay = NodePriorityGraph(gs, lib).replay if np_ else gs.replay
        except Exception as e:  # the node-priority path depends on torch and the runtime
            print(f"B={batch} {name}: skipped ({type(e).__name__}: {e})", flush=True)
            torch.cuda.synchronize()
            continue
        graphs[name] = (gs, replay)
    rounds = {n: [] for n in graphs}
    for _ in range(args.runs):
        for name, (gs, replay) in graphs.items():
            for _ in range(args.warm):
                gs.stage_next()
                replay()
            rounds[name].append(statistics.median(timed(replay, gs, args.steps)))
    ref = graphs["resident"][0].step
    out = dict(batch=batch, runs=args.runs, steps=args.steps, modes={})
    for name, (gs, _) in graphs.items():
        t = rounds[name]
        ratios = [a / b for a, b in zip(t, rounds["resident"])]
        added = [(a - b) * 1e3 / cfg.layers for a, b in zip(t, rounds["resident"])]
        same = torch.equal(gs.step.tokens, ref.tokens) and torch.equal(gs.step.hidden, ref.hidden)
        out["modes"][name] = dict(
            ms_per_step=statistics.median(t),
            ms_min=min(t),
            ms_max=max(t),
            ratio=statistics.median(ratios),
            added_us_per_layer=statistics.median(added),
            bit_identical=same,
        )
        m = out["modes"][name]
        print(
            f"B={batch} {name:24s} {m['ms_per_step']:8.3f} ms "
            f"({m['ms_min']:.3f}-{m['ms_max']:.3f}) "
            f"ratio {m['ratio']:.3f} added {m['added_us_per_layer']:7.1f} us/layer same {same}",
            flush=True,
        )
    del graphs
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--hot", type=int, default=4096)
    ap.add_argument("--batches", default="64,112")
    ap.add_argument("--miss", type=float, default=0.05)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = GraphConfig.deepseek_v32(layers=args.layers, ctx_len=args.ctx, hot_size=args.hot)
    batches = [int(b) for b in args.batches.split(",")]
    lib = _cudart()
    lo, hi = torch.cuda.Stream.priority_range()
    print(f"stream priorities {lo}..{hi}; cudart {'found' if lib else 'not found'}", flush=True)
    w = Weights(cfg, "cuda")
    kv = KVStore(cfg, max(batches), "cuda")
    rows = [run_batch(cfg, w, kv, b, args, lib) for b in batches]
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, args=vars(args))
    res["batches"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
