"""An experiment: the misses' rows copied host -> hot by SM loads from a few CTAs, a warp per
row and many rows in flight per warp, instead of copy_misses' grid over every request.

Why: on an H200, copy_misses (4 programs per request, most of the GPU's SMs) reaches 44 GB/s
alone but beside the HBM-bound row read both kernels slow down (overlap -0.36 to 0.13), while
bulk copies (tma_gather.py) overlap the read but move only 20-25 GB/s. A PCIe transfer needs
only ~120 KB in flight (61 GB/s x ~2 us), so a handful of SMs can keep the link busy if each
warp keeps several rows in flight; the rest of the GPU stays the read's. ``reserve`` bytes of
dynamic shared memory per CTA (unused) keep the read's CTAs that need shared memory off those SMs.

On an H200 (results/pcie_overlap_h200.md, runs 3-4) 16-32 CTAs move 44 GB/s alone and overlap
the read 0.80-0.86 at batch 64 (0.20-0.50 at 112), against 0.10 for copy_misses' old grid; the
engine's copy_misses now takes the same form in Triton (16 programs), which did as well.

Warps are spread over the requests (S = warps / batch per request, at least 1); a warp loads
``rows`` rows (41 16-byte chunks each, one or two per lane) before storing any of them. Built on
first use with torch's inline extension loader.
"""

from __future__ import annotations

from cuda_timing import sm90a_module

CUDA_SRC = r"""
#include <cstdint>
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

namespace {

constexpr int kRowBytes = 656;
constexpr int kChunks = kRowBytes / 16;  // 41

template <int R>
__global__ void warp_gather_kernel(const uint8_t* __restrict__ host, uint8_t* __restrict__ hot,
                                   const int32_t* __restrict__ src,
                                   const int32_t* __restrict__ dst,
                                   const int32_t* __restrict__ count, int batch, int width) {
  const int lane = threadIdx.x & 31;
  const int warp = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
  const int nw = static_cast<int>((gridDim.x * blockDim.x) >> 5);
  const int per = nw / batch > 0 ? nw / batch : 1;  // warps per request
  const int groups = nw / per;
  if (warp >= groups * per) return;
  const int s = warp % per;
  for (int b = warp / per; b < batch; b += groups) {
    const int c = count[b];
    for (int j0 = s * R; j0 < c; j0 += per * R) {
      uint4 v[R][2];
      int64_t to[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int j = j0 + r;
        to[r] = -1;
        if (j < c) {
          const int64_t at = static_cast<int64_t>(b) * width + j;
          const uint4* from =
              reinterpret_cast<const uint4*>(host + static_cast<int64_t>(src[at]) * kRowBytes);
          to[r] = dst[at];
          v[r][0] = from[lane];
          if (lane < kChunks - 32) v[r][1] = from[32 + lane];
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (to[r] < 0) continue;
        uint4* into = reinterpret_cast<uint4*>(hot + to[r] * kRowBytes);
        into[lane] = v[r][0];
        if (lane < kChunks - 32) into[32 + lane] = v[r][1];
      }
    }
  }
}

}  // namespace

void warp_gather(torch::Tensor host, torch::Tensor hot, torch::Tensor src, torch::Tensor dst,
                 torch::Tensor count, int64_t ctas, int64_t threads, int64_t rows,
                 int64_t reserve) {
  TORCH_CHECK(host.is_pinned() && hot.is_cuda(), "host must be pinned, hot on the GPU");
  TORCH_CHECK(hot.size(1) == kRowBytes, "rows must be 656 bytes");
  auto args = [&](auto k) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(reserve)));
    k<<<static_cast<int>(ctas), static_cast<int>(threads), static_cast<int>(reserve),
        c10::cuda::getCurrentCUDAStream()>>>(
        host.data_ptr<uint8_t>(), hot.data_ptr<uint8_t>(), src.data_ptr<int32_t>(),
        dst.data_ptr<int32_t>(), count.data_ptr<int32_t>(), static_cast<int>(dst.size(0)),
        static_cast<int>(dst.size(1)));
  };
  if (rows == 2) args(warp_gather_kernel<2>);
  else if (rows == 4) args(warp_gather_kernel<4>);
  else if (rows == 8) args(warp_gather_kernel<8>);
  else TORCH_CHECK(false, "rows must be 2, 4 or 8");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

DECLARATION = (
    "void warp_gather(torch::Tensor, torch::Tensor, torch::Tensor, "
    "torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, int64_t);"
)


def warp_gather(
    host, hot, miss_src, miss_dst, miss_count, *, ctas=16, threads=512, rows=4, reserve=0
):
    """``hot[miss_dst[b, i]] = host[miss_src[b, i]]`` for ``i < miss_count[b]`` by ``ctas`` CTAs
    of ``threads`` threads, a warp per row, ``rows`` rows in flight per warp."""
    module = sm90a_module("hisparse_warp_gather", DECLARATION, CUDA_SRC)
    module.warp_gather(host, hot, miss_src, miss_dst, miss_count, ctas, threads, rows, reserve)
