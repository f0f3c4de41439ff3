"""What-if for bench_decode_tpot.py: the misses' copy done by a copy kernel of a capped grid.

`hisparse.ops.gather` launches every SM times its occupancy, and its warps hold those SMs while
they wait on PCIe, so the compute it is meant to hide under cannot run beside it
(an experiment since removed, docs/experiments.md: hidden 0.34 for the op, 0.83-0.89 for
8-32 blocks at the same speed).
This swaps each HiSparse runtime's `gather` of one decode step for a plain row copy of `blocks`
CTAs (built with CuPy), launched exactly where the runtime launches its own: on the index
group's copy stream after its resolve, recording the layer's ready event. It copies the same
rows, so the step stays bit-identical (the benchmark checks it); it does not count moved bytes.
A measurement aid for the ops owners, not engine code: it reads the runtime's private
`_resolved` event.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

# CuPy 14 deprecates ExternalStream (still works); keep the benchmark's log readable.
warnings.filterwarnings("ignore", category=DeprecationWarning, module="capped_gather")

KERNEL = r"""
extern "C" __global__ void gather_plan(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                       const int* __restrict__ miss_src,
                                       const int* __restrict__ miss_dst,
                                       const int* __restrict__ count, int B, int K, int words) {
  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int nw = (gridDim.x * blockDim.x) >> 5;
  const int chunks = (K + 15) / 16;
  for (int item = warp; item < B * chunks; item += nw) {
    const int r = item / chunks, m0 = (item % chunks) * 16;
    const int n = min(max(count[r], 0), K);
    if (m0 >= n) continue;
    const int m1 = min(m0 + 16, n);
    for (int base = m0; base < m1; base += 4) {
      uint4 v[4][2];
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int i = base + u, w = lane + 32 * k;
          if (i < m1 && w < words) v[u][k] = src[(long long)miss_src[r * K + i] * words + w];
        }
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const int i = base + u, w = lane + 32 * k;
          if (i < m1 && w < words) dst[(long long)miss_dst[r * K + i] * words + w] = v[u][k];
        }
    }
  }
}
"""


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _capped(rt, kern, blocks: int, cupy):
    g = rt.index_group
    if not (rt.host_view.is_contiguous() and rt.hot_view.is_contiguous()):
        raise ValueError("the capped copy takes contiguous row views")

    def gather() -> None:
        g.copy_stream.wait_event(g._resolved)
        with torch.cuda.stream(g.copy_stream):
            stream = cupy.cuda.ExternalStream(g.copy_stream.cuda_stream)
            args = (_ptr(rt.host_view), _ptr(rt.hot_view), _ptr(g.miss_src), _ptr(g.miss_dst))
            sizes = (np.int32(g.batch), np.int32(g.top_k), np.int32(rt.row_bytes // 16))
            kern((blocks,), (256,), (*args, _ptr(g.miss_count), *sizes), stream=stream)
            rt.ready.record(g.copy_stream)

    return gather


def cap_gathers(step, blocks: int) -> None:
    """Replace the gathers of every host part of `step` (a DecodeStep) before it is captured."""
    import cupy  # the GPU image's CuPy compiles the kernel (NVRTC)

    kern = cupy.RawKernel(KERNEL, "gather_plan")
    for p in step.parts:
        for rt in p.runtimes if p.host else ():
            rt.gather = _capped(rt, kern, blocks, cupy)
