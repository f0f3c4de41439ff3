// Device helpers more than one op's kernel uses (resolve_residency.cu, copy_rows.cu). Inline
// templates only, so each kernel compiles exactly as when all kernels shared one file.
#pragma once

#include <cuda_runtime.h>

namespace hisparse {
namespace cuda {

// Block-wide exclusive prefix sum of one unsigned per thread; `*total` receives the block sum.
// Contains three barriers; every thread of the block must call it.
template <int NT>
__device__ __forceinline__ unsigned block_exclusive_scan(unsigned v, unsigned* warp_tot,
                                                         unsigned* total) {
  constexpr int NW = NT / 32;
  static_assert(NT % 32 == 0 && NW <= 32, "block size");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_tot[warp] = x;
  __syncthreads();
  if (warp == 0) {
    unsigned w = lane < NW ? warp_tot[lane] : 0u;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    if (lane < NW) warp_tot[lane] = w;  // inclusive warp totals
  }
  __syncthreads();
  const unsigned excl = x - v + (warp > 0 ? warp_tot[warp - 1] : 0u);
  *total = warp_tot[NW - 1];
  __syncthreads();  // warp_tot may be reused by the next call
  return excl;
}

}  // namespace cuda
}  // namespace hisparse
