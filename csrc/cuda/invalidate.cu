// invalidate's kernel: bit-identical to cpu_ops.cpp and docs/ops.md; fixed launch geometry,
// graph-capturable.
#include "kernels.cuh"

namespace hisparse {
namespace cuda {
namespace {

__global__ void __launch_bounds__(kInvalidateThreads)
    invalidate_kernel(int32_t* slot_keys, int16_t* lru, const int32_t* state_rows,
                      const int32_t* keys, int64_t N, int64_t S, int H) {
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const int64_t s = state_rows[i];
    if (s < 0 || s >= S) continue;
    int32_t* row = slot_keys + s * H;
    if (keys == nullptr) {
      int16_t* order = lru + s * H;
      for (int j = threadIdx.x; j < H; j += kInvalidateThreads) {
        row[j] = -1;
        order[j] = static_cast<int16_t>(j);
      }
    } else {
      const int k = keys[i];
      if (k < 0) continue;
      for (int j = threadIdx.x; j < H; j += kInvalidateThreads)
        if (row[j] == k) row[j] = -1;
    }
  }
}

}  // namespace

cudaError_t launch_invalidate(int32_t* slot_keys, int16_t* lru, const int32_t* state_rows,
                              const int32_t* keys, int64_t N, int64_t S, int H, int grid,
                              cudaStream_t stream) {
  invalidate_kernel<<<grid, kInvalidateThreads, 0, stream>>>(slot_keys, lru, state_rows, keys, N,
                                                             S, H);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace hisparse
