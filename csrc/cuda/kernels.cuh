// Kernel-side interface of the CUDA backend: plain structs and launchers, no ATen. The torch
// glue (validation, tensors, streams, registration) lives in ops.cpp, compiled by the host
// compiler; keeping ATen out of the .cu keeps nvcc's host pass from emitting private copies of
// libstdc++ templates (which crashed error-message formatting on one toolchain).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "hisparse_limits.h"

namespace hisparse {
namespace cuda {

// resolve_residency: one CTA per batch row. Batches that fit in one CTA per multiprocessor use
// kResolveThreadsWide threads per CTA (batch 1 is then a single wide CTA); larger batches use
// kResolveThreads with two CTAs per multiprocessor. The scanning passes cover kResolveTile
// positions per round (kResolveTile / threads consecutive positions per thread).
constexpr int kResolveThreads = 512;
constexpr int kResolveThreadsWide = 1024;
constexpr int kResolveTile = 4096;
constexpr int kResolvePad = 8;    // scratch arrays padded to this many entries (16-byte loads)
// Hash entries hold the first occurrence (high 16 bits) and the hit slot (low 16 bits) of a
// key in one word; 0xFFFF in a half means none. Entry indices and slots are below kMaxHotSize.
constexpr unsigned kNone16 = 0xFFFFu;
static_assert(kMaxHotSize <= 0xFFFF, "an entry index or slot must fit a 16-bit half below 0xFFFF");
// The hash has cap = 2^k entries with 2K <= cap <= kResolveMaxCapPerKey * K, as large as the
// shared memory of the CTAs sharing a multiprocessor allows (shorter probe chains).
constexpr int kResolveMaxCapPerKey = 8;

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

template <class I>
__host__ __device__ __forceinline__ I round16(I x) {
  return (x + 15) & ~I(15);
}
template <class I>
__host__ __device__ __forceinline__ I padded(I x) {
  return (x + kResolvePad - 1) / kResolvePad * kResolvePad;
}

// Per-row scratch of resolve, in this order (each part 16-byte aligned):
//   hash      cap x key, then cap x (first occurrence << 16 | hit/assigned slot)
//   entries   K (padded to 8) int32: each entry's hash index (tiled path: first the row's keys
//             as loaded; a fused row reads its keys into registers)
//   resident  K (padded to 8) int32: the row's resident rows as loaded (resident tier only)
//   slots     H int32: the state row's slot keys as loaded, then each slot's hash index
//   order     H (padded to 8) int16: the state row's LRU order as loaded
//   list      H int16: evictable slots (front) and hit slots (back) in LRU order (the fused
//             path lists only the evictable slots that misses take)
// Every global read of a row is issued at once (into this scratch; a fused row's keys into
// registers) before any work starts.
// In 32-bit arithmetic (64-bit offsets cost extra prologue instructions in every warp):
// K <= H <= kMaxHotSize and cap <= kResolveMaxCapPerKey * K keep every offset below 2^22.
struct ResolveLayout {
  int entries, resident, slots, order, list, total;
  __host__ __device__ ResolveLayout(int K, int H, int cap, bool has_res) {
    entries = round16(cap * 8);
    resident = entries + round16(padded(K) * 4);
    slots = resident + (has_res ? round16(padded(K) * 4) : 0);
    order = slots + round16(H * 4);
    list = order + round16(padded(H) * 2);
    total = list + round16(H * 2);
  }
};
// The largest row: the hash (8 bytes an entry, at most kResolveMaxCapPerKey per key) plus at most
// 16 bytes per slot and per key for the other parts, and their padding.
static_assert(int64_t(kResolveMaxCapPerKey) * kMaxHotSize * 8 + 32 * kMaxHotSize + 256 < INT_MAX,
              "resolve scratch offsets must fit an int");

// gather and save_rows share one row-copy kernel: work items are (layer, batch row, chunk of
// up to 32 planned rows), one warp per item; a warp moves each row in 16-byte words laid on the
// 128-byte lines of the host-side address, so every line crossing PCIe is requested once.
constexpr int kMaxCopyLayers = 64;      // member layers per launch (larger calls are split)
constexpr int kSmallCopyLayers = 8;
constexpr int kCopyThreads = 256;
constexpr int kCopyWarps = kCopyThreads / 32;
constexpr int kCopyUnroll = 8;          // independent 16-byte loads in flight per lane
constexpr int kCopyMaxBatch = 8192;     // batch rows per launch (chunk prefix in shared memory)
// CTAs of a copy with one side in pinned host memory (HISPARSE_PCIE_COPY_CTAS overrides; 0: no
// cap). PCIe sets its rate, which this many CTAs reach (H200); the other SMs stay free for the
// work beside it, such as the query heads made while a step's misses copy in.
constexpr int kPcieCopyCtas = 32;

struct CopyLayer {
  const uint8_t* src;
  uint8_t* dst;
  int64_t src_block_stride, src_row_stride, dst_block_stride, dst_row_stride;
  int32_t src_block_size, dst_block_size, src_rows, dst_rows;
  int32_t words;  // row_bytes / 16
  int32_t parts;  // warp-wide 16-byte accesses per row: ceil((words + 7) / 32)
};

template <int MAXL>
struct CopyArgs {
  CopyLayer layer[MAXL];
  const int32_t* src_idx;    // [B, K] source row of each planned copy
  const int32_t* dst_idx;    // [B, K] destination row
  const int32_t* count;      // [B] planned copies per batch row; nullptr: all K
  unsigned long long* moved;  // nullptr: not counted
  int B, K, L;
  int chunk_log2;  // planned rows per work item = 1 << chunk_log2 (<= 32)
  int align_dst;   // lay the words on the destination's lines (save: host is the destination)
};

constexpr int kInvalidateThreads = 256;

// Each launcher returns the launch's error status (cudaGetLastError) for the caller to check.
cudaError_t launch_resolve(const ResolveArgs& a, bool wide, int grid, size_t smem,
                           cudaStream_t stream);
cudaError_t set_resolve_max_smem(int bytes);
template <int MAXL>
cudaError_t launch_copy(const CopyArgs<MAXL>& a, int grid, size_t smem, cudaStream_t stream);
int copy_blocks_per_sm(bool many_layers);
cudaError_t launch_invalidate(int32_t* slot_keys, int16_t* lru, const int32_t* state_rows,
                              const int32_t* keys, int64_t N, int64_t S, int H, int grid,
                              cudaStream_t stream);

// topk_slots: a cluster of `cluster` CTAs of kTopkThreads per token, each over `span` positions
// of the row; the writing pass covers kTopkThreads * kTopkItems consecutive positions per round
// (kTopkItems per thread). Slices of at most kTopkCacheRows scores keep their keys in shared
// memory between passes (192 KiB).
constexpr int kTopkThreads = 1024;
constexpr int kTopkItems = 8;
constexpr int kTopkCacheRows = 48 * 1024;
constexpr int kTopkMaxCluster = 8;  // the portable cluster size
// Shared memory a CTA needs with a full cache: the keys and its static arrays.
constexpr int64_t kTopkSmemBytes = int64_t(kTopkCacheRows) * 4 + 4096;

struct TopkSlotsArgs {
  const float* scores;    // [T, L]
  const int64_t* req64;   // [T], one of req64 / req32
  const int32_t* req32;
  const int64_t* bt64;    // [R, W], one of bt64 / bt32
  const int32_t* bt32;
  int64_t* out;           // [T, K]
  int64_t T, L, ld, K, R, W, block_size;  // ld: scores' row stride (elements)
  int64_t span;  // positions per CTA, a multiple of 4; cluster * span >= L
  int cluster;   // CTAs per token, 1 .. kTopkMaxCluster
  bool vec;      // rows 16-byte aligned: four scores per load
  bool cache;    // span <= kTopkCacheRows and topk_slots_allow_cache() succeeded
};

// Lets the kernel take kTopkCacheRows keys of dynamic shared memory (once per device).
cudaError_t topk_slots_allow_cache();
// How many clusters of `cluster` CTAs, each with `smem` bytes of dynamic shared memory, the device
// runs at once (0 where it cannot run one).
int topk_slots_active_clusters(int cluster, size_t smem);
cudaError_t launch_topk_slots(const TopkSlotsArgs& a, cudaStream_t stream);

}  // namespace cuda
}  // namespace hisparse
