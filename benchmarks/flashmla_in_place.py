# ruff: noqa  (a lab script kept for one commit: docs/experiments.md)
"""Lab: FlashMLA reading a HiSparse step's misses in place from the pinned host pool (one VA span
over hot buffer + host pool), against FlashMLA over hot rows only, and the gather it replaces."""

import json
import os
import statistics

import torch

from hisparse import ops
from hisparse.models.dsa.kernels import flashmla
from hisparse.models.rows import encode_rows
from hisparse.runtime.host_pool import HostPool

dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
ROWB = 656


class Span:
    def __init__(self, base, rows):
        self.__cuda_array_interface__ = {
            "shape": (rows, ROWB),
            "typestr": "|u1",
            "data": (base, False),
            "version": 3,
            "strides": None,
        }


def replay(fn, reps=20, calls=5):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ts = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(ts), min(ts), max(ts)


flash = flashmla.find()
print("flash", flash.name)
res = []
K, HOT, CTX = 2048, 4096, 32768
for B in (112, 64, 30, 16, 1):
    torch.manual_seed(B)
    hot = torch.empty(B * HOT, ROWB, dtype=torch.uint8, device=dev)
    hot.copy_(encode_rows(torch.randn(B * HOT, 576, device=dev), "fp8"))
    pool = HostPool(B * CTX * ROWB + ROWB, pin=True)
    hostraw = pool.raw
    ha, da = hostraw.data_ptr(), hot.data_ptr()
    off = (da - ha) % ROWB
    host = hostraw[off : off + B * CTX * ROWB].view(B * CTX, ROWB)
    host.copy_(encode_rows(torch.randn(B * CTX, 576), "fp8"))
    hs = host.data_ptr()
    base = min(da, hs)
    end = max(da + hot.numel(), hs + host.numel())
    rows = -(-(end - base) // ROWB)
    rows += -rows % 64
    span = torch.as_tensor(Span(base, rows), device=dev)
    hot0, host0 = (da - base) // ROWB, (hs - base) // ROWB
    print(
        f"B={B} device {da:#x} host {hs:#x} span rows {rows} hot0 {hot0} host0 {host0} fits int31 {rows < 2**31}",
        flush=True,
    )
    ids = torch.stack(
        [torch.randperm(HOT, device=dev)[:K].sort().values + b * HOT for b in range(B)]
    )
    q = torch.randn(B, 128, 576, device=dev).bfloat16()
    nmiss = round(0.085 * K)
    miss_at = torch.stack([torch.randperm(K, device=dev)[:nmiss] for _ in range(B)])
    keys = torch.stack([torch.randperm(CTX, device=dev)[:nmiss] + b * CTX for b in range(B)])
    # the misses' bytes: put the host rows' bytes in their hot rows for the reference
    hot_ids = ids.gather(1, miss_at)
    ref_hot = hot.clone()
    ref_hot[hot_ids.reshape(-1)] = host[keys.reshape(-1).cpu()].to(dev)
    span_ids = (ids + hot0).clone()
    span_ids.scatter_(1, miss_at, keys + host0)
    hot_span_ids = ids + hot0
    want = flash(q, ref_hot, ids.int(), 0.07)
    got = flash(q, span, span_ids, 0.07)
    same = torch.equal(want, got)
    t_hot = replay(lambda: flash(q, hot, ids.int(), 0.07))
    t_span_allhot = replay(lambda: flash(q, span, hot_span_ids, 0.07))
    t_span = replay(lambda: flash(q, span, span_ids, 0.07))
    # the gather FlashMLA waits for today: the op's gather of the same plan
    src = keys.int().contiguous()
    dst = hot_ids.int().contiguous()
    cnt = torch.full((B,), nmiss, dtype=torch.int32, device=dev)
    moved = torch.zeros(1, dtype=torch.uint64, device=dev)
    t_gather = replay(lambda: ops.gather([host], [hot], src, dst, cnt, moved))
    row = dict(
        batch=B,
        miss_rows=nmiss * B,
        miss_mb=round(nmiss * B * ROWB / 1e6, 2),
        bit_identical=same,
        flash_hot_us=t_hot,
        flash_span_allhot_us=t_span_allhot,
        flash_span_misses_us=t_span,
        gather_us=t_gather,
    )
    print(row, flush=True)
    res.append(row)
    del hostraw, host, hot, span, ref_hot
    torch.cuda.synchronize()
    pool.release()
json.dump(res, open(f"{OUT}/inplace.json", "w"), indent=1)
