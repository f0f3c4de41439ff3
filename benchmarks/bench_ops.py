"""Benchmark of the hisparse data-plane ops (resolve_residency, gather, save_rows) on the CPU or
CUDA backend.

    python benchmarks/bench_ops.py --device cuda --json benchmarks/results/bench_ops_h200.json
    python benchmarks/bench_ops.py --device cpu --quick --json benchmarks/results/bench_ops_cpu.json

A benchmark, not a test: it prints a markdown table (and writes it next to --json as .md). The
first table is the kernel-speed issue's table (resolve, gather, save, CPU resolve throughput),
each figure the median of --reps (default 200) timed calls, with the same-run memcpy ceilings.
Run it twice (a second --json) to show the spread between runs.

Method (CUDA). Inputs are a drifting decode trace: every step keeps each batch row's top-k and
replaces a `miss rate` fraction of it with fresh keys, so the state stays in steady state and the
measured step has the stated miss rate. Each timed call is preceded by a write of a buffer twice
the L2 size (L2 holds nothing of the inputs) and a ~100 us spin that keeps the GPU busy while
the call is queued (host launch latency never lands inside the timed region),
and timed with CUDA events around that one call; the table reports the median. The
resolve floor configuration is also timed as a CUDA-graph replay. Gather plans are drawn fresh
for every call (host rows uniformly across the whole pool, so neither L2 nor the host-side TLBs
see a repeated row), and bulk pinned host-to-device cudaMemcpy of the same pool is measured in
the same run as the ceiling. Gather variants: plans sorted by host address within each batch row,
and index-group co-location (one host row per token holding 4 member layers' rows, each layer a
strided view; one call gathers the 4 layers). save_rows: 256 new rows x 61 layers per step, one
call (one launch) for all layers and one call per layer, against a same-run bulk device-to-host
memcpy of the same bytes. CPU resolve throughput is top-k entries per second on one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

from hisparse import ops
from hisparse.runtime import empty_residency

K_TOP = 2048
H_HOT = 4096
MISS_RATES = (0.001, 0.05, 0.20)
ROW_BYTES = (656, 1152)
I32 = torch.int32


# --------------------------------------------------------------------------------------------
# timing helpers
# --------------------------------------------------------------------------------------------


class CudaTimer:
    """Events around one call, preceded by an L2-sized write and a spin that keeps the GPU busy."""

    def __init__(self, flush_bytes: int):
        self.flush = torch.empty(flush_bytes // 4, dtype=torch.int32, device="cuda")

    def time_us(self, fn, flush=True) -> float:
        if flush:
            self.flush.fill_(1)
        # Keep the GPU busy (~100 us spin, no memory traffic) while the host queues the call:
        # without it a slow host-side launch shows up as idle time inside the timed region.
        torch.cuda._sleep(200000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0


def median(xs):
    return float(statistics.median(xs))


def pct(xs, q):
    ys = sorted(xs)
    return float(ys[min(len(ys) - 1, int(len(ys) * q / 100))])


# --------------------------------------------------------------------------------------------
# resolve
# --------------------------------------------------------------------------------------------


class ResolveSetup:
    def __init__(self, B, device, num_keys=1 << 30, seed=0):
        self.B, self.device, self.num_keys = B, device, num_keys
        self.g = torch.Generator(device=device).manual_seed(seed)
        S = B
        self.slot_keys, self.lru = empty_residency(S, H_HOT, device)
        self.stats = torch.zeros(2, dtype=torch.uint64, device=device)
        self.state_rows = torch.arange(B, dtype=I32, device=device)
        self.out = torch.empty(B, K_TOP, dtype=I32, device=device)
        self.src = torch.empty_like(self.out)
        self.dst = torch.empty_like(self.out)
        self.cnt = torch.empty(B, dtype=I32, device=device)
        self.cur = self._fresh((B, K_TOP))
        self.top_k = self.cur.clone()

    def _fresh(self, shape):
        return torch.randint(
            0, self.num_keys, shape, generator=self.g, dtype=torch.int64, device=self.device
        ).to(I32)

    def advance(self, rate):
        """Next trace step: replace a `rate` fraction of each row with fresh (missing) keys."""
        mask = torch.rand(self.cur.shape, generator=self.g, device=self.device) < rate
        self.cur = torch.where(mask, self._fresh(self.cur.shape), self.cur)
        self.top_k.copy_(self.cur)

    def reset(self):
        """Empty every state row (the next call is a cold start)."""
        ops.invalidate(self.slot_keys, self.lru, self.state_rows)

    def call(self):
        ops.resolve_residency(
            self.top_k,
            self.state_rows,
            self.slot_keys,
            self.lru,
            self.stats,
            self.out,
            self.src,
            self.dst,
            self.cnt,
            num_keys=self.num_keys,
        )


def bench_resolve(device, batches, reps, timer, graph_cfg=None, rates=MISS_RATES, cold=False):
    """Drifting-trace resolve at each (batch, miss rate); `cold` adds batch 1 from an empty state
    with 100 % misses. graph_cfg: a (batch, rate) or a set of them also timed as graph replays."""
    rows = []
    graph_set = (
        set()
        if graph_cfg is None
        else ({graph_cfg} if isinstance(graph_cfg, tuple) else set(graph_cfg))
    )
    configs = [(B, rate) for B in batches for rate in rates]
    if cold:
        configs.append((1, 1.0))
    for B, rate in configs:
        st = ResolveSetup(B, device, seed=B)
        pre = st.reset if rate == 1.0 else None
        st.call()  # cold fill
        for _ in range(3):
            st.advance(rate)
            st.call()
        times, misses = [], []
        for _ in range(reps):
            st.advance(rate)
            if pre is not None:
                pre()
            if device == "cuda":
                times.append(timer.time_us(st.call))
            else:
                t0 = time.perf_counter()
                st.call()
                times.append((time.perf_counter() - t0) * 1e6)
            misses.append(int(st.cnt.sum()))
        med = median(times)
        row = dict(
            op="resolve",
            device=device,
            batch=B,
            top_k=K_TOP,
            hot=H_HOT,
            miss_rate=rate,
            cold=rate == 1.0,
            measured_miss_rate=sum(misses) / (reps * B * K_TOP),
            reps=reps,
            median_us=med,
            p10_us=pct(times, 10),
            p90_us=pct(times, 90),
            rows_per_s=B / (med * 1e-6),
            entries_per_s=B * K_TOP / (med * 1e-6),
        )
        if device == "cuda":
            warm = []
            for _ in range(max(10, reps // 2)):
                st.advance(rate)
                if pre is not None:
                    pre()
                warm.append(timer.time_us(st.call, flush=False))
            row["median_us_warm_l2"] = median(warm)
            if (B, rate) in graph_set:
                row["median_us_graph"] = graph_resolve(st, rate, reps, timer, pre)
        rows.append(row)
        extra = f" graph {row['median_us_graph']:.1f} us" if "median_us_graph" in row else ""
        print(f"  resolve B={B:4d} miss={rate:5.3f}: {med:9.1f} us{extra}", flush=True)
    return rows


def graph_resolve(st, rate, reps, timer, pre=None):
    """The same call captured in a CUDA graph; inputs change between replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        st.call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        st.call()
    return timed_steps(st, rate, reps, timer, graph.replay, pre)


def timed_steps(st, rate, reps, timer, fn, pre=None):
    """Median µs of `fn`, timed once after each of `reps` steps of the trace (`pre` before each)."""
    times = []
    for _ in range(reps):
        st.advance(rate)
        if pre is not None:
            pre()
        times.append(timer.time_us(fn))
    return median(times)


# --------------------------------------------------------------------------------------------
# gather
# --------------------------------------------------------------------------------------------


def alloc_pool(nbytes, device):
    if device == "cuda":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t = torch.empty(nbytes, dtype=torch.uint8)
    t.fill_(7)  # touch the pages
    return t


def make_plan(B, count, pool_rows, hot_rows_per_req, device, g):
    """Misses spread uniformly over the pool; destinations are distinct rows of each request."""
    src = torch.randint(0, pool_rows, (B, K_TOP), generator=g, dtype=torch.int64, device=device).to(
        I32
    )
    perm = torch.argsort(torch.rand(B, hot_rows_per_req, generator=g, device=device), dim=1)
    dst = (perm[:, :K_TOP] + torch.arange(B, device=device)[:, None] * hot_rows_per_req).to(I32)
    cnt = torch.full((B,), count, dtype=I32, device=device)
    return src, dst, cnt


def bench_gather(device, pools, batches, reps, timer, single=True):
    """Single-layer gathers of every (pool, row size, batch, miss rate), plus one request's 2048
    misses when `single`."""
    rows = []
    for pool_gib, pool in pools:
        for row_bytes in ROW_BYTES:
            cases = [
                dict(B=B, rate=rate, count=max(1, round(rate * K_TOP)))
                for B in batches
                for rate in MISS_RATES
            ]
            if single:
                cases.append(dict(B=1, rate=1.0, count=K_TOP))  # one request's 2048 misses
            for c in cases:
                c["row_bytes"] = row_bytes
            rows += gather_cases(device, pool_gib, pool, cases, reps, timer)
    return rows


def gather_cases(device, pool_gib, pool, cases, reps, timer):
    """Each case: B, rate, count (misses per batch row), row_bytes, optional layers (> 1: the
    pool holds one host row per token with `layers` member rows next to each other, and one
    call gathers every member layer) and sort (plans sorted by host address in each row)."""
    rows = []
    g = torch.Generator(device=device).manual_seed(1)
    for c in cases:
        B, rate, count, row_bytes = c["B"], c["rate"], c["count"], c["row_bytes"]
        L, sort = c.get("layers", 1), c.get("sort", False)
        pool_rows = pool.numel() // (row_bytes * L)
        packed = pool[: pool_rows * row_bytes * L].view(pool_rows, L, row_bytes)
        host = [packed[:, l] for l in range(L)]
        hot = [
            torch.zeros(B * H_HOT, row_bytes, dtype=torch.uint8, device=device) for _ in range(L)
        ]
        moved = torch.zeros(1, dtype=torch.uint64, device=device)
        times = []
        for i in range(reps + 3):
            src, dst, cnt = make_plan(B, count, pool_rows, H_HOT, device, g)
            if sort:
                src[:, :count] = src[:, :count].sort(dim=1).values

            def call(hot=hot, src=src, dst=dst, cnt=cnt):
                ops.gather(host, hot, src, dst, cnt, moved)

            if device == "cuda":
                t = timer.time_us(call)
            else:
                t0 = time.perf_counter()
                call()
                t = (time.perf_counter() - t0) * 1e6
            if i >= 3:
                times.append(t)
        med = median(times)
        nbytes = B * count * row_bytes * L
        moved_total = moved.cpu().tolist()[0]
        assert moved_total == (reps + 3) * nbytes, (moved_total, nbytes)
        rows.append(
            dict(
                op="gather",
                device=device,
                pool_gib=pool_gib,
                row_bytes=row_bytes,
                batch=B,
                miss_rate=rate,
                rows=B * count,
                layers=L,
                sorted=sort,
                bytes=nbytes,
                reps=reps,
                median_us=med,
                p10_us=pct(times, 10),
                p90_us=pct(times, 90),
                gbps=nbytes / (med * 1e-6) / 1e9,
                rows_per_s=B * count * L / (med * 1e-6),
                single_request=(rate == 1.0),
            )
        )
        tag = (f" L={L} co-located" if L > 1 else "") + (" sorted" if sort else "")
        print(
            f"  gather pool={pool_gib:g}GiB row={row_bytes} B={B:4d} miss={rate:5.3f}{tag}: "
            f"{med:9.1f} us {rows[-1]['gbps']:6.1f} GB/s",
            flush=True,
        )
        del hot
    return rows


# --------------------------------------------------------------------------------------------
# save_rows
# --------------------------------------------------------------------------------------------


def bench_save(reps, timer, new_rows=256, layers=61, row_bytes=656, host_rows=1 << 17):
    """One decode step's new rows (256 x 61 layers) from device views into a pinned host pool:
    one save_rows call for all layers (one launch), one call per layer, and a bulk
    device-to-host memcpy of the same bytes (the ceiling)."""
    dev_rows = 4 * new_rows
    src_raw = torch.randint(0, 256, (layers, dev_rows, row_bytes), dtype=torch.uint8, device="cuda")
    host_raw = torch.empty(layers * host_rows * row_bytes, dtype=torch.uint8, pin_memory=True)
    src = [src_raw[l] for l in range(layers)]
    layer_major = [
        host_raw[l * host_rows * row_bytes : (l + 1) * host_rows * row_bytes].view(
            host_rows, row_bytes
        )
        for l in range(layers)
    ]
    # token-major: one host row per token holding all its layers' rows (40 KB), each layer a
    # strided view; a step's rows then share pages across layers
    packed = host_raw[: host_rows * layers * row_bytes].view(host_rows, layers, row_bytes)
    token_major = [packed[:, l] for l in range(layers)]
    g = torch.Generator(device="cuda").manual_seed(3)
    moved = torch.zeros(1, dtype=torch.uint64, device="cuda")
    nbytes = new_rows * layers * row_bytes
    out = []
    for mode in ("one call", "per layer", "one call, token-major"):
        host = token_major if mode.endswith("token-major") else layer_major
        times = []
        for i in range(reps + 3):
            s_rows = torch.randperm(dev_rows, generator=g, device="cuda")[:new_rows].to(I32)
            h_rows = (torch.randperm(host_rows, generator=g, device="cuda")[:new_rows]).to(I32)

            if mode != "per layer":

                def call():
                    ops.save_rows(src, host, s_rows, h_rows, moved)
            else:

                def call():
                    for l in range(layers):
                        ops.save_rows(src[l : l + 1], host[l : l + 1], s_rows, h_rows, moved)

            t = timer.time_us(call)
            if i >= 3:
                times.append(t)
        med = median(times)
        out.append(
            dict(
                op="save_rows",
                mode=mode,
                new_rows=new_rows,
                layers=layers,
                row_bytes=row_bytes,
                bytes=nbytes,
                reps=reps,
                median_us=med,
                p10_us=pct(times, 10),
                p90_us=pct(times, 90),
                gbps=nbytes / (med * 1e-6) / 1e9,
                launches=layers if mode == "per layer" else 1,
            )
        )
        print(
            f"  save_rows {new_rows} rows x {layers} layers ({mode}): {med:8.1f} us "
            f"{out[-1]['gbps']:5.1f} GB/s",
            flush=True,
        )
    assert moved.cpu().tolist()[0] == 3 * (reps + 3) * nbytes
    # ceiling: one bulk copy of the same bytes, device -> pinned host
    dsrc = src_raw.view(-1)[:nbytes]
    ddst = host_raw[:nbytes]
    times = []
    for i in range(reps + 3):
        t = timer.time_us(lambda: ddst.copy_(dsrc, non_blocking=True))
        if i >= 3:
            times.append(t)
    med = median(times)
    out.append(
        dict(
            op="memcpy_d2h",
            mode="bulk memcpy",
            new_rows=new_rows,
            layers=layers,
            row_bytes=row_bytes,
            bytes=nbytes,
            reps=reps,
            median_us=med,
            p10_us=pct(times, 10),
            p90_us=pct(times, 90),
            gbps=nbytes / (med * 1e-6) / 1e9,
            launches=1,
        )
    )
    print(
        f"  memcpy D2H {nbytes / 2**20:.1f} MiB: {med:8.1f} us {out[-1]['gbps']:5.1f} GB/s",
        flush=True,
    )
    del host_raw
    return out


def bench_cpu_resolve(reps, batches=(64,), rates=(0.001, 0.20)):
    """CPU backend resolve on one thread: top-k entries per second per core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = bench_resolve("cpu", batches, reps, None, rates=rates)
    finally:
        torch.set_num_threads(threads)
    for r in rows:
        r["threads"] = 1
    return rows


def bench_connector_host(reps, batches=(1, 8), layers=4, top_k=64, row_bytes=656, device="cpu"):
    """Host time of the connector's per-layer decode calls, one thread: a save of the step's new
    rows, the leader's resolve (resolve + its gather) and a follower's (gather only), through
    HiSparseConnectorImpl as an engine calls it. On the CPU build that includes the CPU kernels'
    work; on CUDA it is the host's part alone (Python and launches, the step's tensors already
    on the device; the step ends in a synchronize outside the timing, as a sampler's does).
    Median of the last 2/3 of ``reps`` steps (the first third warms the hot buffers)."""
    from hisparse.connector import HiSparseConfig, HiSparseConnectorImpl, StepSchedule

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows_out = []
    try:
        for B in batches:
            cfg = HiSparseConfig(
                top_k=top_k, max_num_seqs=16, block_size=16, index_share=2, host_pool_gib=0.05
            )
            work = HiSparseConnectorImpl(cfg, "worker")
            names = [f"l{i}" for i in range(layers)]
            hot = cfg.max_num_seqs * cfg.hot_size
            work.register_kv_caches(
                {n: torch.zeros(hot, row_bytes, dtype=torch.uint8, device=device) for n in names}
            )
            sched = HiSparseConnectorImpl(cfg, "scheduler", host_rows=work.worker.host_rows)
            reqs = {f"r{b}": 1 for b in range(B)}
            sched.build_connector_meta(StepSchedule({r: 1000 for r in reqs}))
            g = torch.Generator().manual_seed(0)
            t = {"save": [], "leader": [], "follower": []}
            new = torch.zeros(B, row_bytes, dtype=torch.uint8, device=device)
            for step in range(reps):
                work.bind_connector_metadata(sched.build_connector_meta(StepSchedule(dict(reqs))))
                work.start_load_kv(None)
                top = torch.randint(0, 1000 + step, (B, top_k), generator=g, dtype=torch.int32)
                slots = torch.arange(B, dtype=torch.int64) * 1000 + 1000 + step
                top, slots = top.to(device), slots.to(device)
                for i, n in enumerate(names):
                    t0 = time.perf_counter()
                    work.save_kv_layer(n, new, None, slot_mapping=slots)
                    t1 = time.perf_counter()
                    work.resolve(n, top if i % 2 == 0 else None)
                    t2 = time.perf_counter()
                    t["save"].append(t1 - t0)
                    t["leader" if i % 2 == 0 else "follower"].append(t2 - t1)
                    work.wait_for_layer_load(n)
                work.clear_connector_metadata()
                work.get_kv_connector_stats()
                if device == "cuda":
                    torch.cuda.synchronize()
            work.shutdown()
            row = {"B": B, "device": device, "top_k": top_k, "row_bytes": row_bytes, "threads": 1}
            for k, xs in t.items():
                row[f"{k}_us"] = median(xs[len(xs) // 3 :]) * 1e6
            rows_out.append(row)
            print(
                f"  connector host time ({device}) B={B}: save {row['save_us']:.1f} us, "
                f"leader resolve {row['leader_us']:.1f} us, "
                f"follower {row['follower_us']:.1f} us per layer call",
                flush=True,
            )
    finally:
        torch.set_num_threads(threads)
    return rows_out


def bench_fence(reps, timer, layers=61):
    """The shared pool's GPU flags (hisparse.runtime.device_fence), one rank alone: per layer a
    signal and a wait that is already met (what a reader pays when rank 0 is ahead), captured as
    one step of ``layers`` layers; and the host time to enqueue them eagerly."""
    from hisparse.runtime.device_fence import DeviceFence
    from hisparse.runtime.pool_fence import PoolFence, control_bytes
    from hisparse.runtime.shared_pool import SharedHostPool

    pool = SharedHostPool.create(1 << 20, control_bytes(2, layers), what="bench pool")
    pool.pin(what="bench pool")
    fence = PoolFence(pool.control, 0, 2, layers, 60.0)
    dev = DeviceFence(fence, pool.control_address, torch.device("cuda"), on_fault=print)
    # rank 0's step waits for rank 1's done flag: set it far ahead so every wait is met
    fence._set(fence.done_flag(1), 1 << 40)

    def step():
        dev.begin_step()
        for layer in range(layers):
            dev.layer_written(layer)
            dev._wait(fence.written_flag(layer), 0, 0, layer)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        host_us = (time.perf_counter() - t0) / (10 * layers * 2) * 1e6
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            step()
    gpu = [timer.time_us(graph.replay, flush=False) / layers for _ in range(reps)]
    pool.release()
    out = dict(
        layers=layers,
        graph_us_per_layer=median(gpu),
        graph_us_per_layer_p10_p90=[pct(gpu, 10), pct(gpu, 90)],
        host_us_per_launch=host_us,
    )
    print(
        f"  fence: {out['graph_us_per_layer']:.2f} us per layer (signal + met wait, captured), "
        f"{host_us:.1f} us host per eager launch",
        flush=True,
    )
    return out


def bench_memcpy(pool, reps, chunk=64 << 20):
    """Bulk pinned host -> device copies of `chunk` bytes at spread offsets of the pool: the
    ceiling."""
    n = min(chunk, pool.numel())
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    times = []
    span = max(1, pool.numel() - n + 1)
    for i in range(reps + 2):
        off = ((i * 7919) * n) % span
        src = pool[off : off + n]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) * 1000.0)
    med = median(times)
    return dict(
        op="memcpy_h2d",
        bytes=n,
        reps=reps,
        median_us=med,
        gbps=n / (med * 1e-6) / 1e9,
        p10_gbps=n / (pct(times, 90) * 1e-6) / 1e9,
        p90_gbps=n / (pct(times, 10) * 1e-6) / 1e9,
    )


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def issue_table(res):
    """The kernel-speed issue's rows: (workload, measured, goal, met)."""
    out = []

    def add(what, value, unit, goal, ok, note=""):
        out.append(dict(workload=what, value=value, unit=unit, goal=goal, met=ok, note=note))

    def rz(B, rate):
        m = [r for r in res.get("resolve", []) if r["batch"] == B and r["miss_rate"] == rate]
        return m[0] if m else None

    if res["device"] != "cuda":  # the CPU run reports the CPU throughput rows only
        res = dict(cpu_resolve=res.get("cpu_resolve", []))
    r = rz(64, 0.001)
    if r:
        v = r.get("median_us_graph", r["median_us"])
        add(
            "resolve, batch 64 @0.1 % misses (graph replay)",
            v,
            "µs",
            "≤ 10",
            v <= 10,
            f"eager {r['median_us']:.1f} µs",
        )
    r = rz(256, 0.20)
    if r:
        v = r["median_us"]
        g = r.get("median_us_graph")
        add(
            "resolve, batch 256 @20 %",
            v,
            "µs",
            "≤ 20",
            v <= 20,
            "" if g is None else f"graph replay {g:.1f} µs",
        )
    r = rz(1, 1.0)
    if r:
        v = r["median_us"]
        g = r.get("median_us_graph")
        add(
            "resolve, batch 1, cold (100 % misses)",
            v,
            "µs",
            "≤ 10",
            v <= 10,
            "" if g is None else f"graph replay {g:.1f} µs",
        )
    mem = {m["pool_gib"]: m["gbps"] for m in res.get("memcpy", [])}

    def ga(pool, rb, B, rate, layers=1, sort=False):
        m = [
            x
            for x in res.get("gather", [])
            if x["pool_gib"] == pool
            and x["row_bytes"] == rb
            and x["batch"] == B
            and x["miss_rate"] == rate
            and x.get("layers", 1) == layers
            and x.get("sorted", False) == sort
        ]
        return m[0] if m else None

    for rb in ROW_BYTES:
        x = ga(1, rb, 256, 0.20)
        if x and 1 in mem:
            frac = 100 * x["gbps"] / mem[1]
            add(
                f"gather, 1 GiB pool, batch 256 @20 %, {rb}-B rows",
                x["gbps"],
                "GB/s",
                "≥ 85 % of memcpy",
                frac >= 85,
                f"{frac:.0f} % of same-run memcpy {mem[1]:.1f} GB/s",
            )
        for B, rate, name in (
            (256, 0.20, "batch 256 @20 %"),
            (1, 1.0, "one request's 2048 misses"),
        ):
            x = ga(32, rb, B, rate)
            if x:
                add(
                    f"gather, 32 GiB pool, {name}, {rb}-B rows",
                    x["gbps"],
                    "GB/s",
                    "≥ 30",
                    x["gbps"] >= 30,
                    f"{x['rows_per_s'] / 1e6:.1f} M rows/s",
                )
            x = ga(32, rb, B, rate, sort=True)
            if x:
                add(
                    "  same, plan sorted by host address in each row",
                    x["gbps"],
                    "GB/s",
                    "≥ 30",
                    x["gbps"] >= 30,
                    f"{x['rows_per_s'] / 1e6:.1f} M rows/s",
                )
            x = ga(32, rb, B, rate, layers=4)
            if x:
                add(
                    "  same, index group of 4 co-located (4 layers per call)",
                    x["gbps"],
                    "GB/s",
                    "≥ 30",
                    x["gbps"] >= 30,
                    f"{x['rows_per_s'] / 1e6:.1f} M layer-rows/s",
                )
    sv = {x["mode"]: x for x in res.get("save", [])}
    if "one call" in sv and "bulk memcpy" in sv:
        one, mc = sv["one call"], sv["bulk memcpy"]
        add(
            f"save {one['new_rows']} new rows x {one['layers']} layers, one launch",
            one["median_us"],
            "µs/step",
            "one launch per group",
            True,
            f"{one['gbps']:.1f} GB/s; bulk D2H memcpy of the same bytes {mc['median_us']:.1f} µs "
            f"({mc['gbps']:.1f} GB/s)"
            + (
                f"; one call per layer {sv['per layer']['median_us']:.1f} µs"
                if "per layer" in sv
                else ""
            ),
        )
    if "one call, token-major" in sv:
        tm = sv["one call, token-major"]
        add(
            "  same, token-major host rows (a token's 61 layer rows adjacent)",
            tm["median_us"],
            "µs/step",
            "one launch per group",
            True,
            f"{tm['gbps']:.1f} GB/s",
        )
    for r in res.get("cpu_resolve", []):
        v = r["entries_per_s"] / 1e6
        add(
            f"CPU resolve, batch {r['batch']} @{r['miss_rate'] * 100:g} %, one thread",
            v,
            "M entries/s/core",
            "≥ 20",
            v >= 20,
            f"{r['median_us']:.0f} µs per call",
        )
    return out


def markdown(res):
    out = []
    env = res["env"]
    out.append(f"# bench_ops — {env['device_name']} ({res['device']})\n")
    how = (
        "median of CUDA-event-timed calls, L2 flushed and GPU kept busy before each call "
        "(warm-L2 and graph replay columns as labelled)"
        if res["device"] == "cuda"
        else f"median wall-clock time per call, {env['threads']} threads"
    )
    out.append(
        f"torch {env['torch']}, {env['when']}; top-k {K_TOP}, hot {H_HOT}; {how}; "
        f"{env.get('reps', '?')} timed calls per figure"
        f"{'; quick run' if env['quick'] else ''}.\n"
    )
    if "timer_floor_us" in res:
        out.append(
            f"Timer floor: a trivial kernel measures {res['timer_floor_us']:.1f} µs with the "
            "same method (launch and event overhead included in every figure).\n"
        )
    if res.get("issue"):
        out.append("## Issue table (kernel speed, round 2)\n")
        out += ["| workload | measured | goal | met | note |", "|---|---:|---|:--:|---|"]
        for x in res["issue"]:
            out.append(
                f"| {x['workload']} | {x['value']:.1f} {x['unit']} | {x['goal']} | "
                f"{'yes' if x['met'] else 'no'} | {x['note']} |"
            )
        out.append("")
    if "memcpy" in res:
        out.append(
            "Bulk pinned host→device memcpy (ceiling, 64 MiB copies): "
            + ", ".join(f"{m['pool_gib']:g} GiB pool {m['gbps']:.1f} GB/s" for m in res["memcpy"])
            + "\n"
        )
    out.append("## resolve_residency\n")
    hdr = "| batch | miss rate | measured | median µs | p10–p90 µs | rows/s |"
    sep = "|---:|---:|---:|---:|---:|---:|"
    if res["device"] == "cuda":
        hdr += " warm-L2 µs | graph µs |"
        sep += "---:|---:|"
    out += [hdr, sep]
    for r in res["resolve"]:
        rate = "cold 100%" if r.get("cold") else f"{r['miss_rate'] * 100:g}%"
        line = (
            f"| {r['batch']} | {rate} | {r['measured_miss_rate'] * 100:.2f}% "
            f"| {r['median_us']:.1f} | {r['p10_us']:.1f}–{r['p90_us']:.1f} "
            f"| {r['rows_per_s']:.3g} |"
        )
        if res["device"] == "cuda":
            g = r.get("median_us_graph")
            line += f" {r['median_us_warm_l2']:.1f} | {'' if g is None else f'{g:.1f}'} |"
        out.append(line)
    if res.get("cpu_resolve"):
        out.append("\n## CPU resolve, one thread\n")
        out += ["| batch | miss rate | median µs | M entries/s/core |", "|---:|---:|---:|---:|"]
        for r in res["cpu_resolve"]:
            out.append(
                f"| {r['batch']} | {r['miss_rate'] * 100:g}% | {r['median_us']:.0f} | "
                f"{r['entries_per_s'] / 1e6:.1f} |"
            )
    out.append("\n## gather\n")
    out += [
        "| pool | row B | layers | batch | misses/row | rows | median µs | p10–p90 µs | GB/s "
        "| rows/s |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["gather"]:
        mr = "2048 (1 req)" if r["single_request"] else f"{r['miss_rate'] * 100:g}%"
        lay = f"{r.get('layers', 1)}" + (" co-located" if r.get("layers", 1) > 1 else "")
        lay += " sorted" if r.get("sorted") else ""
        out.append(
            f"| {r['pool_gib']:g} GiB | {r['row_bytes']} | {lay} | {r['batch']} | {mr} | "
            f"{r['rows']} | {r['median_us']:.1f} | {r['p10_us']:.1f}–{r['p90_us']:.1f} | "
            f"{r['gbps']:.1f} | {r['rows_per_s']:.3g} |"
        )
    if res.get("save"):
        out.append("\n## save_rows (one decode step's new rows, device → pinned host)\n")
        out += [
            "| mode | new rows | layers | row B | launches | median µs | p10–p90 µs | GB/s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in res["save"]:
            out.append(
                f"| {r['mode']} | {r['new_rows']} | {r['layers']} | {r['row_bytes']} | "
                f"{r['launches']} | {r['median_us']:.1f} | "
                f"{r['p10_us']:.1f}–{r['p90_us']:.1f} | {r['gbps']:.1f} |"
            )
    return "\n".join(out) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and configurations")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per figure (default 200)")
    ap.add_argument("--json", help="write results here (and a markdown table next to it)")
    ap.add_argument(
        "--connector-only",
        action="store_true",
        help="only the connector's host time per layer call (one thread; --device's build)",
    )
    ap.add_argument(
        "--fence-only",
        action="store_true",
        help="only the shared pool's GPU flags (cuda): per-layer cost captured, host launch time",
    )
    ap.add_argument(
        "--pools-gib",
        default=None,
        help="comma-separated host pool sizes in GiB (cuda default 1,32; cpu 1)",
    )
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device")
    torch.manual_seed(0)
    reps = args.reps or (20 if args.quick else 200)
    if dev == "cuda":
        batches = (1, 8, 64, 256)
        pools_gib = [1.0, 32.0]
        props = torch.cuda.get_device_properties(0)
        name = props.name
        timer = CudaTimer(max(2 * props.L2_cache_size, 64 << 20))
    else:
        batches = (1, 8, 64)
        pools_gib = [1.0]
        name = platform.processor() or platform.machine()
        timer = None
    if args.quick and dev == "cpu":
        pools_gib = [0.25]
    if args.pools_gib:
        pools_gib = [float(x) for x in args.pools_gib.split(",")]
    res = dict(
        device=dev,
        env=dict(
            torch=torch.__version__,
            device_name=name,
            when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            threads=torch.get_num_threads(),
            quick=args.quick,
            reps=reps,
        ),
    )
    if dev == "cuda":  # what a trivial kernel measures with the same method
        res["timer_floor_us"] = median(
            [timer.time_us(lambda: torch.cuda._sleep(1)) for _ in range(reps)]
        )
        print(f"[{name}] timer floor (trivial kernel): {res['timer_floor_us']:.1f} us", flush=True)
    if args.fence_only:
        if dev != "cuda":
            sys.exit("--fence-only needs --device cuda")
        res["fence"] = bench_fence(reps, timer)
        if args.json:
            _write_json(args.json, res)
        return 0
    print(f"[{name}] connector host time per layer call (one thread)", flush=True)
    res["connector_host"] = bench_connector_host(max(30, reps))
    if dev == "cuda":
        res["connector_host"] += bench_connector_host(max(30, reps), device="cuda")
    if args.connector_only:
        if args.json:
            _write_json(args.json, res)
        return 0
    print(f"[{name}] resolve", flush=True)
    graph_cfg = {(64, 0.001), (256, 0.20), (1, 1.0)} if dev == "cuda" else None
    res["resolve"] = bench_resolve(dev, batches, reps, timer, graph_cfg=graph_cfg, cold=True)
    print(f"[{name}] CPU resolve, one thread", flush=True)
    res["cpu_resolve"] = bench_cpu_resolve(max(10, reps // 4) if dev == "cuda" else reps)
    if dev == "cuda":
        print(f"[{name}] save_rows", flush=True)
        res["save"] = bench_save(reps, timer)
    pools = []
    for gib in pools_gib:
        t0 = time.time()
        pools.append((gib, alloc_pool(int(gib * (1 << 30)), dev)))
        print(f"  allocated {gib:g} GiB pool in {time.time() - t0:.1f} s", flush=True)
    if dev == "cuda":
        res["memcpy"] = []
        for gib, pool in pools:
            m = bench_memcpy(pool, reps=reps)
            m["pool_gib"] = gib
            res["memcpy"].append(m)
            print(f"  memcpy H2D {gib:g} GiB pool: {m['gbps']:.1f} GB/s", flush=True)
    print(f"[{name}] gather", flush=True)
    res["gather"] = []
    gbatches = (64, 256) if dev == "cuda" else batches
    for gib, pool in pools:
        cases = []
        for rb in ROW_BYTES:
            cases += [
                dict(B=B, rate=rate, count=max(1, round(rate * K_TOP)), row_bytes=rb)
                for B in gbatches
                for rate in (0.05, 0.20)
            ]
            cases.append(dict(B=1, rate=1.0, count=K_TOP, row_bytes=rb))
        if gib == max(pools_gib) and dev == "cuda":
            for extra in (dict(sort=True), dict(layers=4)):
                cases.append(
                    dict(B=256, rate=0.20, count=round(0.2 * K_TOP), row_bytes=656, **extra)
                )
                cases.append(dict(B=1, rate=1.0, count=K_TOP, row_bytes=656, **extra))
        res["gather"] += gather_cases(dev, gib, pool, cases, reps, timer)
    res["issue"] = issue_table(res)
    md = markdown(res)
    print()
    print(md)
    if args.json:
        _write_json(args.json, res)
        with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
            f.write(md)
    return 0


def _write_json(path: str, res: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
