// Kernel-side interface of the CUDA backend: plain structs and launchers, no ATen. The torch
// glue (validation, tensors, streams, registration) lives in ops.cpp, compiled by the host
// compiler; keeping ATen out of the .cu keeps nvcc's host pass from emitting private copies of
// libstdc++ templates (which crashed error-message formatting on one toolchain).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace hisparse {
namespace cuda {

constexpr int kResolveThreads = 512;
constexpr int kResolveItems = 8;  // consecutive positions per thread in the scanning passes
constexpr int kResolveTile = kResolveThreads * kResolveItems;
constexpr int kNone = INT_MAX;  // "no slot" / "no occurrence" in the hash

struct ResolveArgs {
  const int32_t* top_k;
  const int32_t* state_rows;
  const int32_t* resident;  // nullptr when the resident tier is off
  int32_t* slot_keys;
  int16_t* lru;
  unsigned long long* stats;
  int32_t* out_rows;
  int32_t* miss_src;
  int32_t* miss_dst;
  int32_t* miss_count;
  uint8_t* workspace;  // nullptr: scratch in dynamic shared memory
  int64_t ws_stride;   // bytes of workspace per CTA
  int B, K, S, H;
  int num_keys, hot_base, cap_log2;
};

__host__ __device__ __forceinline__ int64_t round16(int64_t x) { return (x + 15) & ~int64_t(15); }

// Per-row scratch: open-addressing hash of the row's selected keys (key, first occurrence,
// hit/assigned slot), the hash index of every entry, the evictable/hit slot lists, the hit-slot
// bitmap.
__host__ __device__ __forceinline__ int64_t resolve_scratch_bytes(int K, int H, int cap) {
  return int64_t(cap) * 12 + round16(int64_t(K) * 4) + round16(int64_t(H) * 2) +
         round16(int64_t((H + 31) / 32) * 4);
}

constexpr int kMaxGatherLayers = 64;
constexpr int kSmallGatherLayers = 8;
constexpr int kGatherThreads = 128;
constexpr int kGatherRows = 16;     // misses of one batch row per work item
constexpr int kGatherUnroll = 8;    // independent 16-byte loads in flight per thread
constexpr int kGatherMaxBatch = 8192;  // batch rows per launch (chunk prefix in shared memory)

struct GatherLayer {
  const uint8_t* src;
  uint8_t* dst;
  int64_t src_block_stride, src_row_stride, dst_block_stride, dst_row_stride;
  int32_t src_block_size, dst_block_size, src_rows, dst_rows;
  int32_t words;  // row_bytes / 16
};

template <int MAXL>
struct GatherArgs {
  GatherLayer layer[MAXL];
  const int32_t* miss_src;
  const int32_t* miss_dst;
  const int32_t* miss_count;
  unsigned long long* moved;  // nullptr: not counted
  int B, K, L;
};

constexpr int kInvalidateThreads = 256;

// Each launcher returns the launch's error status (cudaGetLastError) for the caller to check.
cudaError_t launch_resolve(const ResolveArgs& a, int grid, size_t smem, cudaStream_t stream);
cudaError_t set_resolve_max_smem(int bytes);
template <int MAXL>
cudaError_t launch_gather(const GatherArgs<MAXL>& a, int grid, size_t smem, cudaStream_t stream);
cudaError_t launch_invalidate(int32_t* slot_keys, int16_t* lru, const int32_t* state_rows,
                              const int32_t* keys, int64_t N, int64_t S, int H, int grid,
                              cudaStream_t stream);

}  // namespace cuda
}  // namespace hisparse
