"""Experiment (leaves the tree after): the op's gather of a decode step's misses, timed over the
graph step's own pools (one pinned pool per layer) against one pool, a small pool and one large
pool, alone and beside a matrix-product load on the compute stream."""

import argparse
import json

import torch

import hisparse.ops as ops

ROW = 656


def plans(B, region, hot, m, n, g):
    out = []
    for _ in range(n):
        src = torch.zeros(B, 2048, dtype=torch.int32)
        dst = torch.zeros(B, 2048, dtype=torch.int32)
        for b in range(B):
            src[b, :m] = (b * region + torch.randperm(region - 64, generator=g)[:m]).int()
            dst[b, :m] = (b * hot + torch.randperm(hot, generator=g)[:m]).int()
        cnt = torch.full((B,), m, dtype=torch.int32)
        out.append((src.cuda(), dst.cuda(), cnt.cuda()))
    return out


def time_case(pools, hot, pl, layers, reps, load=None):
    side = torch.cuda.Stream()
    moved = torch.zeros(1, dtype=torch.uint64, device="cuda")
    def run(i):
        for l in range(layers):
            p = pl[(i * layers + l) % len(pl)]
            ops.gather([pools[l % len(pools)]], [hot], *p, moved)
    for i in range(3):
        run(i)
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        if load is not None:
            load()  # compute stream busy while the side stream copies
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            s.record()
            run(i)
            e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1000 / layers)
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=112)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--misses", type=int, default=95)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    B, L, m = a.batch, a.layers, a.misses
    region = a.context + 64
    g = torch.Generator().manual_seed(0)
    hot = torch.zeros(B * 4096, ROW, dtype=torch.uint8, device="cuda")
    pl = plans(B, region, 4096, m, 16, g)
    nbytes = B * m * ROW
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    def load():
        for _ in range(6):
            x @ x
    res = {}
    def report(name, pools, load_fn=None):
        med, lo, hi = time_case(pools, hot, pl, L, a.reps, load_fn)
        res[name] = dict(us=med, lo=lo, hi=hi, gbs=nbytes / med / 1e3)
        print(f"{name:28s} {med:8.1f} us/layer  [{lo:.1f}, {hi:.1f}]  {nbytes / med / 1e3:5.1f} GB/s", flush=True)

    pool_rows = B * region
    print(f"batch {B}, {m} misses each, {nbytes / 1e6:.2f} MB per layer, pool {pool_rows * ROW / 1e9:.2f} GB")
    pools = [torch.empty(pool_rows, ROW, dtype=torch.uint8, pin_memory=True) for _ in range(L)]
    report("eight pools", pools)
    report("one pool (pools[0])", pools[:1])
    report("eight pools + matmul load", pools, load)
    report("one pool + matmul load", pools[:1], load)
    del pools
    torch.cuda.empty_cache()
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    small_region = 2048 + 64
    pl_small = plans(B, small_region, 4096, m, 16, g)
    small = [torch.empty(B * small_region, ROW, dtype=torch.uint8, pin_memory=True)]
    med, lo, hi = time_case(small, hot, pl_small, L, a.reps)
    res["small pool"] = dict(us=med, lo=lo, hi=hi, gbs=nbytes / med / 1e3, gb=B * small_region * ROW / 1e9)
    print(f"{'small pool':28s} {med:8.1f} us/layer  {nbytes / med / 1e3:5.1f} GB/s ({B * small_region * ROW / 1e9:.2f} GB)")
    big = torch.empty(L * pool_rows, ROW, dtype=torch.uint8, pin_memory=True)
    views = [big[l * pool_rows:(l + 1) * pool_rows] for l in range(L)]
    report("one big pool, layer regions", views)
    if a.json:
        json.dump(dict(args=vars(a), mb_per_layer=nbytes / 1e6, results=res), open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
