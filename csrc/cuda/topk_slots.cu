// topk_slots: each token's top-k positions by score, written as slots in ascending position
// order (docs/ops.md). One CTA per token: four 8-bit radix passes over the row's order-preserving
// keys find the k-th largest key, then one pass writes the positions above it and the lowest
// equal ones, in position order, through the block table. No sort, no host sync, one launch.
#include <cuda_runtime.h>

#include "kernels.cuh"

namespace hisparse {
namespace cuda {
namespace {

constexpr int kWarps = kTopkThreads / 32;

// Float -> unsigned key with the same order (larger float, larger key); -0.0 is +0.0 (equal
// scores must tie).
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = __float_as_uint(x);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// NaN and -inf are not candidates (-inf: a position past the token's own).
__device__ __forceinline__ bool candidate(float x) { return x > -INFINITY; }

// One bin increment per distinct bin in the warp: scores of one magnitude share their top digit,
// and 32 lanes hitting one shared counter would serialize.
__device__ __forceinline__ void count_bin(unsigned* hist, unsigned bin, bool active) {
  const unsigned lanes = __ballot_sync(0xffffffffu, active);
  if (!active) return;
  const unsigned same = __match_any_sync(lanes, bin);
  if ((threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
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

__global__ void __launch_bounds__(kTopkThreads) topk_slots_kernel(const TopkSlotsArgs a) {
  __shared__ unsigned hist[256];
  __shared__ unsigned long long warp_sums[kWarps];
  __shared__ uint32_t s_prefix;
  __shared__ unsigned s_need, s_total;

  const int64_t t = blockIdx.x;
  const float* row = a.scores + t * a.L;
  int64_t* out = a.out + t * a.K;
  const int64_t r = a.req64 ? a.req64[t] : int64_t(a.req32[t]);
  if (r < 0 || r >= a.R) {  // not a request of this batch: nothing selected
    for (int64_t j = threadIdx.x; j < a.K; j += blockDim.x) out[j] = -1;
    return;
  }

  // The k-th largest key, one 8-bit digit per pass, among the keys matching the digits so far.
  uint32_t prefix = 0, mask = 0;
  unsigned need = static_cast<unsigned>(a.K);
  bool take_all = false;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
    __syncthreads();
    for (int64_t base = 0; base < a.L; base += blockDim.x) {
      const int64_t p = base + threadIdx.x;
      bool active = false;
      unsigned bin = 0;
      if (p < a.L) {
        const float x = row[p];
        const uint32_t k = order_key(x);
        active = candidate(x) && (k & mask) == prefix;
        bin = (k >> shift) & 0xFFu;
      }
      count_bin(hist, bin, active);
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the digit holding the need-th largest, from the top bin down
      const int lane = threadIdx.x;
      unsigned c[8], sum = 0;
      for (int i = 0; i < 8; ++i) sum += (c[i] = hist[255 - (lane * 8 + i)]);
      unsigned incl = sum;
      for (int d = 1; d < 32; d <<= 1) {
        const unsigned y = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += y;
      }
      const unsigned all = __shfl_sync(0xffffffffu, incl, 31);
      const unsigned above0 = incl - sum;  // keys in bins above this lane's eight
      const bool here = above0 < need && need <= incl;
      if (shift == 24 && lane == 0) s_total = all;
      if (here) {
        unsigned above = above0;
        int i = 0;
        while (above + c[i] < need) above += c[i++];
        s_prefix = prefix | (uint32_t(255 - (lane * 8 + i)) << shift);
        s_need = need - above;
      }
    }
    __syncthreads();
    if (shift == 24 && s_total <= need) {  // K or fewer candidates: every one is selected
      take_all = true;
      break;
    }
    prefix = s_prefix;
    need = s_need;
    mask |= 0xFFu << shift;
    __syncthreads();  // s_prefix / s_need are written again by the next pass
  }
  // Selected: keys above `prefix`, then the first `need` keys equal to it by position.
  const uint32_t kth = prefix;
  const unsigned eq_take = take_all ? 0u : need;
  const int64_t bs = a.block_size;
  const int64_t* bt64 = a.bt64 ? a.bt64 + r * a.W : nullptr;
  const int32_t* bt32 = a.bt32 ? a.bt32 + r * a.W : nullptr;
  unsigned long long run = 0;  // (above << 32 | equal) before this tile
  constexpr int64_t kTile = int64_t(kTopkThreads) * kTopkItems;
  for (int64_t base = 0; base < a.L; base += kTile) {
    const int64_t p0 = base + int64_t(threadIdx.x) * kTopkItems;
    unsigned char flag[kTopkItems];  // 1: above, 2: equal
    unsigned n_above = 0, n_eq = 0;
#pragma unroll
    for (int i = 0; i < kTopkItems; ++i) {
      flag[i] = 0;
      const int64_t p = p0 + i;
      if (p < a.L) {
        const float x = row[p];
        if (candidate(x)) {
          const uint32_t k = order_key(x);
          if (take_all || k > kth) flag[i] = 1;
          else if (k == kth) flag[i] = 2;
        }
      }
      n_above += flag[i] == 1;
      n_eq += flag[i] == 2;
    }
    unsigned long long tile_total;
    const unsigned long long mine = (static_cast<unsigned long long>(n_above) << 32) | n_eq;
    const unsigned long long before = run + block_exclusive_sum(mine, warp_sums, &tile_total);
    run += tile_total;
    unsigned above = static_cast<unsigned>(before >> 32);
    unsigned eq = static_cast<unsigned>(before & 0xFFFFFFFFu);
#pragma unroll
    for (int i = 0; i < kTopkItems; ++i) {
      if (flag[i] == 0) continue;
      int64_t at;
      if (flag[i] == 1) {
        at = int64_t(above) + (eq < eq_take ? eq : eq_take);
        ++above;
      } else {
        if (eq >= eq_take) continue;
        at = int64_t(above) + eq;
        ++eq;
      }
      const int64_t p = p0 + i;
      const int64_t blk = bt64 ? bt64[p / bs] : int64_t(bt32[p / bs]);
      out[at] = blk * bs + p % bs;
    }
  }
  const int64_t written =
      take_all ? int64_t(s_total) : static_cast<int64_t>(a.K);
  for (int64_t j = written + threadIdx.x; j < a.K; j += blockDim.x) out[j] = -1;
}

}  // namespace

cudaError_t launch_topk_slots(const TopkSlotsArgs& a, cudaStream_t stream) {
  topk_slots_kernel<<<static_cast<unsigned>(a.T), kTopkThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace hisparse
