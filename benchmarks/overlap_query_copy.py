"""Lab (run on an H200, 2026-12-04): can a step's misses copy hide under the layer's miss-independent
query path (q_b_proj, rope, absorption into the 576-wide query)? python overlap_query_copy.py 30,64,112"""
import json, os, statistics, sys
import torch, triton, triton.language as tl
from hisparse import ops
from hisparse.runtime.host_pool import HostPointer
from hisparse.models.rows import encode_rows
from hisparse.models.dsa.kernels import elementwise as ew

dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
ROWB = 656

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

def copy_fn(host32, hot32, src, dst, P, R, warps):
    hp = HostPointer(host32.data_ptr(), torch.int32)
    n = src.numel()
    return lambda: _copy[(P,)](hp, hot32, src, dst, n, P, R, 256, num_warps=warps)

def graph_us(fns_by_stream, reps=20, calls=5):
    streams = [torch.cuda.Stream() for _ in fns_by_stream]
    for fs in fns_by_stream:
        for f in fs: f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=side):
        cap = torch.cuda.current_stream()
        for _ in range(calls):
            ev = torch.cuda.Event(); ev.record(cap)
            for s, fs in zip(streams, fns_by_stream):
                s.wait_event(ev)
                with torch.cuda.stream(s):
                    for f in fs: f()
            for s in streams:
                e2 = torch.cuda.Event(); e2.record(s); cap.wait_event(e2)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    ts = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(ts)

def main():
    res = []
    torch.manual_seed(0)
    for B in (int(x) for x in sys.argv[1].split(",")):
        K, HOT, CTX, MISS = 2048, 4096, 32768, 174
        hot = encode_rows(torch.randn(B * HOT, 576, device=dev), "fp8")
        host = torch.empty(B * CTX, ROWB, dtype=torch.uint8, pin_memory=True)
        host.view(torch.int32).random_(0, 1 << 20)
        src = torch.full((B, K), -1, dtype=torch.int32, device=dev)
        dst = torch.full((B, K), -1, dtype=torch.int32, device=dev)
        for b in range(B):
            src[b, :MISS] = (torch.randperm(CTX, device=dev)[:MISS] + b * CTX).int()
            dst[b, :MISS] = (torch.randperm(HOT, device=dev)[:MISS] + b * HOT).int()
        count = torch.full((B,), MISS, dtype=torch.int32, device=dev)
        fs, fd = src[:, :MISS].reshape(-1).contiguous(), dst[:, :MISS].reshape(-1).contiguous()
        mb = fs.numel() * ROWB / 1e6
        hot32, host32 = hot.view(torch.int32), host.view(torch.int32)
        copies = {"op_gather": lambda: ops.gather([host], [hot], src, dst, count)}
        for P, R, W in ((64, 8, 4),):
            copies[f"tri_{P}x{W}w"] = copy_fn(host32, hot32, fs, fd, P, R, W)
        ref = hot.clone(); ref[fd.long()] = host[fs.cpu().long()].to(dev)
        for name, f in copies.items():
            hot.zero_(); f(); torch.cuda.synchronize()
            print(name, "copy ok", torch.equal(hot[fd.long()], ref[fd.long()]), flush=True)
        # the query path of one layer: q_b_proj, rope on the 64 values, absorption, the q buffer
        qr = torch.randn(B, 1536, device=dev).bfloat16()
        wqb = (torch.randn(128 * 192, 1536, device=dev) * 0.02).bfloat16()
        wuk = (torch.randn(128, 128, 512, device=dev) * 0.05).bfloat16()
        cos, sin = torch.randn(B, 64, device=dev).bfloat16(), torch.randn(B, 64, device=dev).bfloat16()
        def qpath():
            q = torch.nn.functional.linear(qr, wqb).view(B, 128, 192)
            ew.rope_(q, cos, sin, start=128, interleaved=True)
            buf = torch.empty(B, 128, 576, dtype=torch.bfloat16, device=dev)
            torch.bmm(q[..., :128].transpose(0, 1), wuk, out=buf[..., :512].transpose(0, 1))
            buf[..., 512:] = q[..., 128:]
            return buf
        def gemm_only():
            return torch.nn.functional.linear(qr, wqb)
        for oname, ofn in (("qpath", qpath),):
            a = graph_us([[ofn]])
            for cname, cfn in copies.items():
                c = graph_us([[cfn]])
                both = graph_us([[ofn], [cfn]])
                ov = (a + c - both) / min(a, c)
                row = dict(batch=B, other=oname, copy=cname, cap=os.environ.get("HISPARSE_PCIE_COPY_CTAS"), misses_mb=round(mb, 2), other_us=round(a, 1),
                           copy_us=round(c, 1), copy_gbs=round(mb / c * 1e3, 1), both_us=round(both, 1),
                           serial_us=round(a + c, 1), overlap=round(ov, 2))
                print(row, flush=True); res.append(row)
        del host
    json.dump(res, open(f"{OUT}/overlap_q_{os.environ.get('HISPARSE_PCIE_COPY_CTAS')}.json", "w"), indent=1)

main()
