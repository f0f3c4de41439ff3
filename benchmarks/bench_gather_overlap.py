"""Can a miss copy hide under compute? The op's gather against a copy kernel of a small grid.

    python benchmarks/bench_gather_overlap.py --json benchmarks/results/gather_overlap_h200.json

The op's gather (`hisparse.ops.gather`) launches a fixed grid of every SM times its occupancy, and
its warps wait on PCIe for the whole copy; bench_decode_tpot.py sees HiSparse's step grow by about
the copy's duration even though the main stream never waits for it. This measures why: a batch
64 decode's misses (102 rows of 656 B per request, drawn from each request's own 32k-token region
of a pinned pool) are copied (a) alone, (b) beside a fixed compute load (bf16 matrix products of
an MLP's shape) on another stream, by the op and by a plain row-copy kernel (one warp per row,
4 rows in flight per warp; built with CuPy) of 4 to 132 blocks. Hidden = (compute alone + copy
alone - both together) / copy alone. CUDA events, median of `--reps` with the spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np
import torch

from hisparse import ops

ROW, CTX, B, MISSES = 656, 32768, 64, 102
KERNEL = r"""
extern "C" __global__ void copy_rows(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                     const int* __restrict__ s_rows, const int* __restrict__ d_rows,
                                     int n, int words) {
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nw = (gridDim.x * blockDim.x) >> 5;
  for (int base = warp * 4; base < n; base += nw * 4) {
    uint4 v[4][2];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int i = base + u, w = lane + 32 * k;
        if (i < n && w < words) v[u][k] = src[(long long)s_rows[i] * words + w];
      }
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int i = base + u, w = lane + 32 * k;
        if (i < n && w < words) dst[(long long)d_rows[i] * words + w] = v[u][k];
      }
  }
}
"""


def timed(fn, reps):
    out = []
    for _ in range(reps + 2):
        torch.cuda._sleep(200000)  # the GPU stays busy while the host queues the work
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    out = out[2:]
    return dict(median_us=statistics.median(out), min_us=min(out), max_us=max(out))


def setup(g):
    pool = torch.empty(B * CTX * ROW, dtype=torch.uint8, pin_memory=True)
    host = pool.view(B * CTX, ROW)
    hot = torch.zeros(B * 4096, ROW, dtype=torch.uint8, device="cuda")
    pos = torch.rand(B, CTX, generator=g, device="cuda").argsort(dim=1)[:, :MISSES]
    src = (torch.arange(B, device="cuda")[:, None] * CTX + pos).to(torch.int32)
    full = torch.zeros(B, 2048, dtype=torch.int32, device="cuda")
    full[:, :MISSES] = src
    dst = (
        torch.arange(2048, device="cuda")[None, :] + torch.arange(B, device="cuda")[:, None] * 4096
    ).to(torch.int32)
    cnt = torch.full((B,), MISSES, dtype=torch.int32, device="cuda")
    return pool, host, hot, full, dst, cnt


class Rig:
    """The plan, the compute load and the copies, each a callable on the current stream."""

    def __init__(self, cupy):
        g = torch.Generator(device="cuda").manual_seed(0)
        self.pool, self.host, self.hot, self.src, self.dst, self.cnt = setup(g)
        self.s_flat = self.src[:, :MISSES].reshape(-1).contiguous()
        self.d_flat = self.dst[:, :MISSES].reshape(-1).contiguous()
        self.cupy, self.kern = cupy, cupy.RawKernel(KERNEL, "copy_rows")
        self.x = torch.randn(B, 7168, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(7168, 18432, device="cuda", dtype=torch.bfloat16)
        self.side = torch.cuda.Stream()

    def compute(self):
        for _ in range(4):
            self.x @ self.w

    def op_copy(self):
        ops.gather([self.host], [self.hot], self.src, self.dst, self.cnt)

    def small_copy(self, blocks):
        def run():
            stream = self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            a = (np.uint64(self.host.data_ptr()), np.uint64(self.hot.data_ptr()))
            b = (np.uint64(self.s_flat.data_ptr()), np.uint64(self.d_flat.data_ptr()))
            n = np.int32(self.s_flat.numel())
            self.kern((blocks,), (256,), (*a, *b, n, np.int32(ROW // 16)), stream=stream)

        return run

    def both(self, copy):
        def run():
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                copy()
            self.compute()
            torch.cuda.current_stream().wait_stream(self.side)

        return run

    def correct(self, copy) -> bool:
        self.hot.zero_()
        copy()
        torch.cuda.synchronize()
        got = self.hot[self.d_flat.long()].cpu()
        return torch.equal(got, self.host[self.s_flat.long().cpu()])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import cupy  # the image's CuPy builds the reference copy kernel (NVRTC)

    rig = Rig(cupy)
    res = dict(device=torch.cuda.get_device_name(), bytes=B * MISSES * ROW, rows=[])
    t_c = timed(rig.compute, args.reps)
    res["compute_alone"] = t_c
    copies = [("op gather", rig.op_copy)]
    copies += [(f"copy {k} blocks", rig.small_copy(k)) for k in (4, 8, 16, 32, 132)]
    for name, fn in copies:
        ok = rig.correct(fn)
        alone, tog = timed(fn, args.reps), timed(rig.both(fn), args.reps)
        hidden = (t_c["median_us"] + alone["median_us"] - tog["median_us"]) / alone["median_us"]
        res["rows"].append(dict(copy=name, alone=alone, with_compute=tog, hidden=hidden, ok=ok))
        gbps = res["bytes"] / alone["median_us"] / 1e3
        print(
            f"{name:16s} alone {alone['median_us']:7.1f} us ({gbps:5.1f} GB/s)"
            f"  with compute {tog['median_us']:7.1f} (compute alone {t_c['median_us']:.1f})"
            f"  hidden {hidden:5.2f}  correct {ok}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
