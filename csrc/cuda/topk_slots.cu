// topk_slots: each token's top-k positions by score, written as slots in ascending position
// order (docs/ops.md). A cluster of CTAs per token, each over one slice of the row: four 8-bit
// radix passes over the order-preserving keys find the k-th largest key (each pass's histogram
// summed over the cluster through distributed shared memory), then one pass writes the positions
// above it and the lowest equal ones, in position order, through the block table. No sort, no
// host sync, one launch. Slices of up to kTopkCacheRows scores keep their keys in shared memory
// after the first pass (the later passes then read no global memory); longer ones are read again
// at each pass, four scores per load.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include "kernels.cuh"

namespace hisparse {
namespace cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kWarps = kTopkThreads / 32;
constexpr int kUnroll = 4;  // float4 loads in flight per thread in a pass over global memory

// Float -> unsigned key with the same order (larger float, larger key); -0.0 is +0.0 (equal
// scores must tie). NaN and -inf (a position past the token's own) get 0: not candidates, since
// every other float maps above order_key(-inf) = 0x007FFFFF.
__device__ __forceinline__ uint32_t order_key(float x) {
  if (!(x > -INFINITY)) return 0u;
  uint32_t u = __float_as_uint(x);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// One shared-memory increment per lane, or one per warp where every active lane has the same
// bin: scores of one magnitude share their top digits, and 32 lanes hitting one counter would
// serialize (warp match instructions cost more than the conflicts they save).
__device__ __forceinline__ void count_bin(unsigned* hist, unsigned bin, bool active) {
  const unsigned lanes = __ballot_sync(0xffffffffu, active);
  if (lanes == 0) return;
  const int leader = __ffs(lanes) - 1;
  const unsigned first = __shfl_sync(0xffffffffu, bin, leader);
  if (__all_sync(0xffffffffu, !active || bin == first)) {
    if ((threadIdx.x & 31) == leader) atomicAdd(&hist[first], __popc(lanes));
  } else if (active) {
    atomicAdd(&hist[bin], 1u);
  }
}

// Exclusive block-wide prefix sum of v (all threads call it); *total gets the sum.
__device__ __forceinline__ unsigned long long block_exclusive_sum(unsigned long long v,
                                                                 unsigned long long* warp_sums,
                                                                 unsigned long long* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long x = v;
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    unsigned long long w = lane < kWarps ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }
    if (lane < kWarps) warp_sums[lane] = w;  // inclusive
  }
  __syncthreads();
  const unsigned long long before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[kWarps - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

// Four keys from positions p .. p + 3 (p a multiple of 4): one 16-byte load where the row allows.
__device__ __forceinline__ void load4(const float* row, int64_t p, int64_t L, bool vec,
                                      uint32_t k[4]) {
  if (vec && p + 3 < L) {
    const float4 v = *reinterpret_cast<const float4*>(row + p);
    k[0] = order_key(v.x), k[1] = order_key(v.y), k[2] = order_key(v.z), k[3] = order_key(v.w);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) k[i] = p + i < L ? order_key(row[p + i]) : 0u;
  }
}

// The keys of positions p0 .. p0 + kTopkItems - 1 of this CTA's slice, from shared memory or
// from the row.
__device__ __forceinline__ void load_items(const TopkSlotsArgs& a, const uint32_t* cached,
                                           const float* row, int64_t p0, int64_t n,
                                           uint32_t k[kTopkItems]) {
  if (a.cache) {
#pragma unroll
    for (int i = 0; i < kTopkItems; ++i) k[i] = p0 + i < n ? cached[p0 + i] : 0u;
  } else {
#pragma unroll
    for (int i = 0; i < kTopkItems; i += 4) load4(row, p0 + i, n, a.vec, k + i);
  }
}

// A cluster of a.cluster CTAs per token, each holding one slice of the row: every pass counts
// its slice, then each CTA sums the cluster's histograms through distributed shared memory and
// takes the same digit; the writing pass starts each slice after the selected positions of the
// slices before it. A cluster of one is the whole row in one CTA.
__global__ void __launch_bounds__(kTopkThreads) topk_slots_kernel(const TopkSlotsArgs a) {
  extern __shared__ uint32_t cached[];  // the slice's keys, when a.cache
  // Two histograms, one per parity of pass: a pass clears the one the cluster read two passes ago,
  // after the cluster barrier of the pass between.
  __shared__ unsigned hist[2][256];
  __shared__ unsigned total[256];
  __shared__ unsigned long long warp_sums[kWarps];
  __shared__ unsigned long long s_counts, s_run;  // (above << 32 | equal): this slice's, before it
  __shared__ uint32_t s_prefix;
  __shared__ unsigned s_need, s_total;

  const cg::cluster_group cluster = cg::this_cluster();
  const int C = a.cluster;
  // A cluster of one is a plain launch (launch_topk_slots): no cluster barrier, no DSMEM.
  const int rank = C > 1 ? static_cast<int>(cluster.block_rank()) : 0;
  const int64_t t = blockIdx.x / C;
  const int64_t lo = min(a.L, int64_t(rank) * a.span);
  const int64_t n = min(a.L - lo, a.span);  // this CTA's slice: positions lo .. lo + n - 1
  const float* row = a.scores + t * a.ld + lo;
  int64_t* out = a.out + t * a.K;
  const int64_t r = a.req64 ? a.req64[t] : int64_t(a.req32[t]);
  if (r < 0 || r >= a.R) {  // not a request of this batch: nothing selected (whole cluster)
    if (rank == 0)
      for (int64_t j = threadIdx.x; j < a.K; j += blockDim.x) out[j] = -1;
    return;
  }

  // The k-th largest key, one 8-bit digit per pass, among the keys matching the digits so far.
  uint32_t prefix = 0, mask = 0;
  unsigned need = static_cast<unsigned>(a.K);
  bool take_all = false;
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    unsigned* h = hist[pass & 1];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) h[i] = 0;
    __syncthreads();
    if (pass == 0 || !a.cache) {  // from global memory
      constexpr int64_t kStep = int64_t(kTopkThreads) * 4 * kUnroll;
      for (int64_t base = 0; base < n; base += kStep) {
        uint32_t k[kUnroll][4];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          load4(row, base + (int64_t(u) * kTopkThreads + threadIdx.x) * 4, n, a.vec, k[u]);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t p = base + (int64_t(u) * kTopkThreads + threadIdx.x) * 4;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            if (a.cache && pass == 0 && p + i < n) cached[p + i] = k[u][i];
            count_bin(h, (k[u][i] >> shift) & 0xFFu, k[u][i] != 0 && (k[u][i] & mask) == prefix);
          }
        }
      }
    } else {  // from the keys the first pass left in shared memory
      for (int64_t base = 0; base < n; base += kTopkThreads) {
        const int64_t p = base + threadIdx.x;
        const uint32_t k = p < n ? cached[p] : 0u;
        count_bin(h, (k >> shift) & 0xFFu, k != 0 && (k & mask) == prefix);
      }
    }
    if (C > 1) {
      cluster.sync();  // every slice's counts of this pass are in
      for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        unsigned sum = 0;
        for (int j = 0; j < C; ++j) sum += cluster.map_shared_rank(h, j)[i];
        total[i] = sum;
      }
    } else {
      __syncthreads();
      for (int i = threadIdx.x; i < 256; i += blockDim.x) total[i] = h[i];
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the digit holding the need-th largest, from the top bin down
      const int lane = threadIdx.x;
      unsigned c[8], sum = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) sum += (c[i] = total[255 - (lane * 8 + i)]);
      unsigned incl = sum;
      for (int d = 1; d < 32; d <<= 1) {
        const unsigned y = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += y;
      }
      const unsigned above0 = incl - sum;  // keys in bins above this lane's eight
      if (pass == 0 && lane == 31) s_total = incl;
      if (above0 < need && need <= incl) {
        unsigned above = above0;
        int i = 0;
        while (above + c[i] < need) above += c[i++];
        s_prefix = prefix | (uint32_t(255 - (lane * 8 + i)) << shift);
        s_need = need - above;
      }
    }
    __syncthreads();
    if (pass == 0 && s_total <= need) {  // K or fewer candidates: every one is selected
      take_all = true;
      break;
    }
    prefix = s_prefix;
    need = s_need;
    mask |= 0xFFu << shift;
    __syncthreads();  // s_prefix / s_need are written again by the next pass
  }
  // Selected: keys above `prefix`, then the first `need` keys equal to it by position.
  const uint32_t kth = take_all ? 0u : prefix;
  const unsigned eq_take = take_all ? 0u : need;
  constexpr int64_t kTile = int64_t(kTopkThreads) * kTopkItems;
  static_assert(kTopkItems % 4 == 0, "whole 16-byte loads per thread");
  unsigned long long run = 0;  // (above << 32 | equal) before this tile, over the whole row
  if (C > 1) {  // the selected positions of the slices before this one
    unsigned long long mine = 0;
    for (int64_t base = 0; base < n; base += kTile) {
      uint32_t k[kTopkItems];
      load_items(a, cached, row, base + int64_t(threadIdx.x) * kTopkItems, n, k);
#pragma unroll
      for (int i = 0; i < kTopkItems; ++i)
        mine += (static_cast<unsigned long long>(k[i] > kth) << 32) | (k[i] != 0 && k[i] == kth);
    }
    unsigned long long slice_total;
    block_exclusive_sum(mine, warp_sums, &slice_total);
    if (threadIdx.x == 0) s_counts = slice_total;
    cluster.sync();
    if (threadIdx.x == 0) {
      unsigned long long before = 0;
      for (int j = 0; j < rank; ++j) before += *cluster.map_shared_rank(&s_counts, j);
      s_run = before;
    }
    cluster.sync();  // no CTA leaves while another still reads its counts
    run = s_run;
  }
  const int64_t bs = a.block_size;
  const int64_t* bt64 = a.bt64 ? a.bt64 + r * a.W : nullptr;
  const int32_t* bt32 = a.bt32 ? a.bt32 + r * a.W : nullptr;
  for (int64_t base = 0; base < n; base += kTile) {
    const int64_t p0 = base + int64_t(threadIdx.x) * kTopkItems;
    uint32_t k[kTopkItems];
    load_items(a, cached, row, p0, n, k);
    unsigned n_above = 0, n_eq = 0;
#pragma unroll
    for (int i = 0; i < kTopkItems; ++i) {
      n_above += k[i] > kth;
      n_eq += k[i] != 0 && k[i] == kth;
    }
    unsigned long long tile_total;
    const unsigned long long mine = (static_cast<unsigned long long>(n_above) << 32) | n_eq;
    const unsigned long long before = run + block_exclusive_sum(mine, warp_sums, &tile_total);
    run += tile_total;
    unsigned above = static_cast<unsigned>(before >> 32);
    unsigned eq = static_cast<unsigned>(before & 0xFFFFFFFFu);
#pragma unroll
    for (int i = 0; i < kTopkItems; ++i) {
      int64_t at;
      if (k[i] > kth) {
        at = int64_t(above) + (eq < eq_take ? eq : eq_take);
        ++above;
      } else if (k[i] != 0 && k[i] == kth && eq < eq_take) {
        at = int64_t(above) + eq;
        ++eq;
      } else {
        continue;
      }
      const int64_t p = lo + p0 + i;
      const int64_t blk = bt64 ? bt64[p / bs] : int64_t(bt32[p / bs]);
      out[at] = blk * bs + p % bs;
    }
  }
  const int64_t written = take_all ? int64_t(s_total) : static_cast<int64_t>(a.K);
  if (rank == 0)
    for (int64_t j = written + threadIdx.x; j < a.K; j += blockDim.x) out[j] = -1;
}

// A launch of `grid` CTAs in clusters of `cluster`; `attr` must outlive the config.
cudaLaunchConfig_t cluster_launch(int64_t grid, int cluster, size_t smem, cudaStream_t stream,
                                  cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(kTopkThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = static_cast<unsigned>(cluster);
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

}  // namespace

cudaError_t topk_slots_allow_cache() {
  return cudaFuncSetAttribute(topk_slots_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              kTopkCacheRows * int(sizeof(uint32_t)));
}

cudaError_t launch_topk_slots(const TopkSlotsArgs& a, cudaStream_t stream) {
  cudaLaunchAttribute attr;
  const size_t smem = a.cache ? size_t(a.span) * sizeof(uint32_t) : 0;
  cudaLaunchConfig_t cfg = cluster_launch(a.T * a.cluster, a.cluster, smem, stream, &attr);
  if (a.cluster == 1) cfg.numAttrs = 0;  // one CTA per token: no cluster scheduling
  return cudaLaunchKernelEx(&cfg, topk_slots_kernel, a);
}

int topk_slots_active_clusters(int cluster, size_t smem) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_launch(cluster, cluster, smem, nullptr, &attr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, topk_slots_kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return clusters;
}

}  // namespace cuda
}  // namespace hisparse
