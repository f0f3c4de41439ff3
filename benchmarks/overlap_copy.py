# ruff: noqa  (a lab script kept for one commit: docs/experiments.md)
"""Lab: can the misses' PCIe copy run beside FlashMLA / DeepGEMM / topk on other streams?
A copy shaped to co-reside (1-warp CTAs, few registers) vs the op's full-grid gather."""

import json
import os
import statistics

import torch
import triton
import triton.language as tl

from hisparse.models.dsa.kernels import deepgemm, flashmla
from hisparse.models.dsa.kernels.indexer import store_fp8_keys
from hisparse.models.rows import encode_rows
from hisparse.runtime.host_pool import HostPointer

dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
ROWB, WORDS = 656, 164


@triton.jit
def _copy(host, hot, src, dst, n, P: tl.constexpr, R: tl.constexpr, W: tl.constexpr):
    p = tl.program_id(0)
    w = tl.arange(0, W)
    for i in range(p * R, n, P * R):
        r = i + tl.arange(0, R)
        ok = r < n
        s = tl.load(src + r, mask=ok, other=0).to(tl.int64)
        d = tl.load(dst + r, mask=ok, other=0).to(tl.int64)
        m = ok[:, None] & (w[None, :] < 164)
        v = tl.load(host + s[:, None] * 164 + w[None, :], mask=m)
        tl.store(hot + d[:, None] * 164 + w[None, :], v, mask=m)


def copy_fn(host32, hot32, src, dst, P, R, warps, maxnreg):
    hp = HostPointer(host32.data_ptr(), torch.int32)
    n = src.numel()
    kw = dict(num_warps=warps)
    if maxnreg:
        kw["maxnreg"] = maxnreg
    return lambda: _copy[(P,)](hp, hot32, src, dst, n, P, R, 256, **kw)


def graph_us(fns_by_stream, reps=20, calls=5):
    """median us of one replay (of `calls` repetitions) of the given fns, each list on its own stream, forked/joined."""
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in fns_by_stream]
    for fs in fns_by_stream:
        for f in fs:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=side):
        cap = torch.cuda.current_stream()
        for _ in range(calls):
            ev = torch.cuda.Event()
            ev.record(cap)
            for s, fs in zip(streams, fns_by_stream):
                s.wait_event(ev)
                with torch.cuda.stream(s):
                    for f in fs:
                        f()
            for s in streams:
                e2 = torch.cuda.Event()
                e2.record(s)
                cap.wait_event(e2)
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
    return statistics.median(ts)


def main():
    res = []
    flash = flashmla.find()
    dg = deepgemm.find()
    print("flashmla", flash and flash.name, "deepgemm", dg is not None)
    torch.manual_seed(0)
    for B in (112, 64):
        half = B // 2
        K, HOT, CTX, MISS = 2048, 4096, 32768, 174
        hot = encode_rows(torch.randn(B * HOT, 576, device=dev), "fp8")
        host = torch.empty(B * CTX, ROWB, dtype=torch.uint8, pin_memory=True)
        host.view(torch.int32).random_(0, 1 << 20)
        ids = torch.stack(
            [torch.randperm(HOT, device=dev)[:K].sort().values + b * HOT for b in range(B)]
        ).int()
        q = torch.randn(B, 128, 576, device=dev).bfloat16()
        # misses of part B (second half): per request MISS host rows of its own region -> hot rows
        src = torch.cat(
            [torch.randperm(CTX, device=dev)[:MISS] + b * CTX for b in range(half, B)]
        ).int()
        dst = torch.cat(
            [ids[b, torch.randperm(K, device=dev)[:MISS]] for b in range(half, B)]
        ).int()
        mb = src.numel() * ROWB / 1e6
        hot32, host32 = hot.view(torch.int32), host.view(torch.int32)

        def attn(lo, hi):
            qq, ii = q[lo:hi].contiguous(), ids[lo:hi].contiguous()
            return lambda: flash(qq, hot, ii, 0.07)

        copies = {
            "tri_132x1w_r32": copy_fn(host32, hot32, src, dst, 132, 2, 1, 32),
            "tri_264x1w_r32": copy_fn(host32, hot32, src, dst, 264, 2, 1, 32),
            "tri_132x1w": copy_fn(host32, hot32, src, dst, 132, 2, 1, None),
            "tri_16x8w": copy_fn(host32, hot32, src, dst, 16, 16, 8, None),
            "tri_32x4w": copy_fn(host32, hot32, src, dst, 32, 8, 4, None),
            "tri_528x4w": copy_fn(host32, hot32, src, dst, 528, 4, 4, None),
        }
        # check the copy
        hot_ref = hot.clone()
        hot_ref[dst.long()] = host[src.cpu().long()].to(dev)
        try:
            copies["tri_132x1w_r32"]()
            torch.cuda.synchronize()
        except Exception as e:
            print("maxnreg failed", e)
            copies = {k: v for k, v in copies.items() if "r32" not in k}
            copies["tri_132x1w"]()
            torch.cuda.synchronize()
        print("copy ok", torch.equal(hot[dst.long()], hot_ref[dst.long()]))
        # indexer of the other half: DeepGEMM paged logits over CTX keys
        others = {"flash_half": attn(0, half), "flash_full": attn(0, B)}
        if dg is not None:
            blocks = half * CTX // 64
            cache = torch.empty(blocks, 64 * 132, dtype=torch.uint8, device=dev)
            store_fp8_keys(
                cache,
                torch.arange(half * CTX, device=dev),
                torch.randn(half * CTX, 128, device=dev),
                64,
            )
            iq = torch.randn(half, 64, 128, device=dev).bfloat16()
            hw = torch.rand(half, 64, device=dev) * (64 * 128) ** -0.5
            bt = torch.arange(blocks, device=dev, dtype=torch.int32).view(half, -1)
            req = torch.arange(half, device=dev)
            pos = torch.full((half,), CTX - 1, device=dev)
            args = (iq, hw, cache, bt, 64, req, pos)
            others["deepgemm_half"] = lambda: dg(*args)
            sc = dg(*args)
            others["topk_half"] = lambda: sc.topk(K, dim=-1, sorted=False)
        for oname, ofn in others.items():
            a = graph_us([[ofn]])
            for cname, cfn in copies.items():
                try:
                    c = graph_us([[cfn]])
                    both = graph_us([[ofn], [cfn]])
                except Exception as e:
                    print(cname, "failed", type(e).__name__, str(e)[:200])
                    continue
                ov = (a + c - both) / min(a, c)
                row = dict(
                    batch=B,
                    other=oname,
                    copy=cname,
                    misses_mb=round(mb, 2),
                    other_us=round(a, 1),
                    copy_us=round(c, 1),
                    copy_gbs=round(mb / c * 1e3, 1),
                    both_us=round(both, 1),
                    overlap=round(ov, 2),
                )
                print(row, flush=True)
                res.append(row)
    json.dump(res, open(f"{OUT}/overlap.json", "w"), indent=1)


main()
