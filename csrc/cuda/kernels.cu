// CUDA kernels of the hisparse ops: bit-identical to the C++ CPU reference (cpu_ops.cpp) and to
// docs/ops.md. Fixed launch geometry, no host reads of device data: graph-capturable.
#include "kernels.cuh"

namespace hisparse {
namespace cuda {
namespace {

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

__device__ __forceinline__ unsigned hash_slot(int key, int shift) {
  return (static_cast<unsigned>(key) * 0x9E3779B1u) >> shift;
}

__global__ void __launch_bounds__(kResolveThreads, 2)
    resolve_kernel(const ResolveArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ unsigned warp_tot[32];
  constexpr int NT = kResolveThreads;
  const int tid = threadIdx.x;
  const int K = a.K, H = a.H;
  const int cap = 1 << a.cap_log2;
  const int shift = 32 - a.cap_log2;
  const unsigned mask = static_cast<unsigned>(cap - 1);
  uint8_t* base = a.workspace != nullptr ? a.workspace + int64_t(blockIdx.x) * a.ws_stride : smem;
  int* hkey = reinterpret_cast<int*>(base);
  int* hfirst = hkey + cap;
  int* hslot = hfirst + cap;
  int* hidx = hslot + cap;  // per entry: hash index, -1 padding, -2 resident
  int16_t* list = reinterpret_cast<int16_t*>(reinterpret_cast<uint8_t*>(hidx) + round16(int64_t(K) * 4));
  unsigned* bits = reinterpret_cast<unsigned*>(reinterpret_cast<uint8_t*>(list) + round16(int64_t(H) * 2));
  const int nwords = (H + 31) / 32;

  for (int r = blockIdx.x; r < a.B; r += gridDim.x) {
    const int s = a.state_rows[r];
    const bool in_range = s >= 0 && s < a.S;
    bool dup = false;
    if (in_range)
      for (int q = tid; q < r; q += NT) dup |= a.state_rows[q] == s;
    const bool live = in_range && !__syncthreads_or(dup);
    int32_t* out = a.out_rows + int64_t(r) * K;
    if (!live) {  // padding row: rule 0
      for (int i = tid; i < K; i += NT) out[i] = -1;
      if (tid == 0) a.miss_count[r] = 0;
      continue;
    }
    const int32_t* keys = a.top_k + int64_t(r) * K;
    const int32_t* res = a.resident != nullptr ? a.resident + int64_t(r) * K : nullptr;
    int32_t* sk = a.slot_keys + int64_t(s) * H;
    int16_t* order = a.lru + int64_t(s) * H;
    int32_t* msrc = a.miss_src + int64_t(r) * K;
    int32_t* mdst = a.miss_dst + int64_t(r) * K;
    const int row_base = a.hot_base + s * H;

    for (int j = tid; j < cap; j += NT) {
      hkey[j] = -1;
      hfirst[j] = kNone;
      hslot[j] = kNone;
    }
    for (int j = tid; j < nwords; j += NT) bits[j] = 0u;
    __syncthreads();

    // 1. Hash the selected keys; first occurrence by atomicMin (rules 1-3).
    for (int i = tid; i < K; i += NT) {
      const int k = keys[i];
      int idx;
      if (k < 0 || k >= a.num_keys) {
        idx = -1;
      } else if (res != nullptr && res[i] >= 0) {
        idx = -2;
      } else {
        unsigned h = hash_slot(k, shift);
        while (true) {
          const int old = atomicCAS(&hkey[h], -1, k);
          if (old == -1 || old == k) break;
          h = (h + 1) & mask;
        }
        atomicMin(&hfirst[h], i);
        idx = static_cast<int>(h);
      }
      hidx[i] = idx;
    }
    __syncthreads();

    // 2. Hits: the lowest slot holding a selected key.
    for (int j = tid; j < H; j += NT) {
      const int k = sk[j];
      if (k < 0) continue;  // the hash holds keys >= 0 only
      unsigned h = hash_slot(k, shift);
      while (true) {
        const int hk = hkey[h];
        if (hk == k) {
          atomicMin(&hslot[h], j);
          break;
        }
        if (hk == -1) break;
        h = (h + 1) & mask;
      }
    }
    __syncthreads();
    for (int h = tid; h < cap; h += NT) {
      const int v = hslot[h];
      if (v != kNone) atomicOr(&bits[v >> 5], 1u << (v & 31));
    }
    __syncthreads();

    // 3. Walk the LRU order: evictable slots to list[0..E), hit slots to list[H-1..H-NH]
    //    (both in LRU order). Packed counters: low 16 bits evictable, high 16 bits hits.
    unsigned carry = 0;
    for (int t0 = 0; t0 < H; t0 += kResolveTile) {
      int16_t sl[kResolveItems];
      unsigned f[kResolveItems];
      unsigned local = 0;
#pragma unroll
      for (int k = 0; k < kResolveItems; ++k) {
        const int p = t0 + tid * kResolveItems + k;
        unsigned v = 0;
        int16_t x = -1;
        if (p < H) {
          x = order[p];
          if (x >= 0 && x < H) v = ((bits[x >> 5] >> (x & 31)) & 1u) ? 0x10000u : 1u;
        }
        sl[k] = x;
        f[k] = v;
        local += v;
      }
      unsigned tot;
      unsigned run = carry + block_exclusive_scan<NT>(local, warp_tot, &tot);
#pragma unroll
      for (int k = 0; k < kResolveItems; ++k) {
        if (f[k] == 1u)
          list[run & 0xFFFFu] = sl[k];
        else if (f[k] != 0u)
          list[H - 1 - static_cast<int>(run >> 16)] = sl[k];
        run += f[k];
      }
      carry += tot;
    }
    const int E = static_cast<int>(carry & 0xFFFFu);
    const int NH = static_cast<int>(carry >> 16);
    __syncthreads();

    // 4. Number the misses by first occurrence; the m-th takes list[m] (rule 4). Packed
    //    counters: low 16 bits misses, high 16 bits hits (distinct keys).
    carry = 0;
    for (int t0 = 0; t0 < K; t0 += kResolveTile) {
      unsigned f[kResolveItems];
      unsigned local = 0;
#pragma unroll
      for (int k = 0; k < kResolveItems; ++k) {
        const int i = t0 + tid * kResolveItems + k;
        unsigned v = 0;
        if (i < K) {
          const int h = hidx[i];
          if (h >= 0 && hfirst[h] == i) v = hslot[h] == kNone ? 1u : 0x10000u;
        }
        f[k] = v;
        local += v;
      }
      unsigned tot;
      unsigned run = carry + block_exclusive_scan<NT>(local, warp_tot, &tot);
#pragma unroll
      for (int k = 0; k < kResolveItems; ++k) {
        if (f[k] == 1u) {
          const int m = static_cast<int>(run & 0xFFFFu);
          if (m < E) {  // otherwise no evictable slot is left (corrupted LRU only)
            const int i = t0 + tid * kResolveItems + k;
            const int h = hidx[i];
            const int slot = list[m];
            const int key = hkey[h];
            hslot[h] = slot;  // only the first occurrence's thread touches hslot[h] here
            sk[slot] = key;
            msrc[m] = key;
            mdst[m] = row_base + slot;
          }
        }
        run += f[k];
      }
      carry += tot;
    }
    const int nhits = static_cast<int>(carry >> 16);
    const int M = min(static_cast<int>(carry & 0xFFFFu), E);
    __syncthreads();

    // 5. Outputs (rule 6).
    for (int i = tid; i < K; i += NT) {
      const int h = hidx[i];
      int o;
      if (h == -1) {
        o = -1;
      } else if (h == -2) {
        o = res[i];
      } else {
        const int sl = hslot[h];
        o = sl == kNone ? -1 : row_base + sl;
      }
      out[i] = o;
    }
    // 6. New LRU: untaken evictable, newly filled (miss order), hits (rule 5).
    const int keep = E - M;
    for (int p = tid; p < E + NH; p += NT) {
      int16_t v;
      if (p < keep)
        v = list[M + p];
      else if (p < E)
        v = list[p - keep];
      else
        v = list[H - 1 - (p - E)];
      order[p] = v;
    }
    if (tid == 0) {
      a.miss_count[r] = M;
      atomicAdd(&a.stats[0], static_cast<unsigned long long>(nhits));
      atomicAdd(&a.stats[1], static_cast<unsigned long long>(M));
    }
    __syncthreads();  // scratch is reused by the next row
  }
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) { return __ldcs(p); }

// Work items are (layer, batch row, chunk of kGatherRows misses); a fixed grid walks them.
// Every CTA recomputes the per-row chunk prefix from miss_count (a few KB, from L2), so the
// grid never depends on device data and no CTA sits idle on an empty row.
template <int MAXL>
__global__ void __launch_bounds__(kGatherThreads)
    gather_kernel(const __grid_constant__ GatherArgs<MAXL> a) {
  constexpr int NT = kGatherThreads;
  extern __shared__ int chunk_start[];  // [B + 1]
  __shared__ unsigned warp_tot[32];
  __shared__ const uint4* s_from[kGatherRows];
  __shared__ uint4* s_to[kGatherRows];
  const int tid = threadIdx.x;

  unsigned carry = 0;
  for (int r0 = 0; r0 < a.B; r0 += NT) {
    const int r = r0 + tid;
    unsigned c = 0;
    if (r < a.B) {
      const int n = min(max(a.miss_count[r], 0), a.K);
      c = static_cast<unsigned>((n + kGatherRows - 1) / kGatherRows);
    }
    unsigned tot;
    const unsigned ex = block_exclusive_scan<NT>(c, warp_tot, &tot);
    if (r < a.B) chunk_start[r] = static_cast<int>(carry + ex);
    carry += tot;
  }
  if (tid == 0) chunk_start[a.B] = static_cast<int>(carry);
  __syncthreads();

  const int64_t work = int64_t(carry) * a.L;
  unsigned long long bytes = 0;
  for (int64_t w = blockIdx.x; w < work; w += gridDim.x) {
    const int l = static_cast<int>(w % a.L);
    const int q = static_cast<int>(w / a.L);
    int lo = 0, hi = a.B;  // chunk_start[lo] <= q < chunk_start[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (chunk_start[mid] <= q)
        lo = mid;
      else
        hi = mid;
    }
    const int r = lo;
    const int n = min(max(a.miss_count[r], 0), a.K);
    const int m0 = (q - chunk_start[r]) * kGatherRows;
    const int rows = min(kGatherRows, n - m0);
    const GatherLayer& L = a.layer[l];
    bool ok = false;
    if (tid < rows) {
      const int64_t idx = int64_t(r) * a.K + m0 + tid;
      const int s = a.miss_src[idx];
      const int t = a.miss_dst[idx];
      ok = s >= 0 && s < L.src_rows && t >= 0 && t < L.dst_rows;
      const uint4* from = nullptr;
      uint4* to = nullptr;
      if (ok) {
        from = reinterpret_cast<const uint4*>(L.src + int64_t(s / L.src_block_size) * L.src_block_stride +
                                              int64_t(s % L.src_block_size) * L.src_row_stride);
        to = reinterpret_cast<uint4*>(L.dst + int64_t(t / L.dst_block_size) * L.dst_block_stride +
                                      int64_t(t % L.dst_block_size) * L.dst_row_stride);
      }
      s_from[tid] = from;
      s_to[tid] = to;
    }
    const int nok = __syncthreads_count(ok);
    const int W = L.words;
    const int total = rows * W;
    for (int b = 0; b < total; b += NT * kGatherUnroll) {
      uint4 v[kGatherUnroll];
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int f = b + u * NT + tid;
        v[u] = make_uint4(0u, 0u, 0u, 0u);
        if (f < total) {
          const int row = f / W;
          const uint4* p = s_from[row];
          if (p != nullptr) v[u] = load_stream(p + (f - row * W));
        }
      }
#pragma unroll
      for (int u = 0; u < kGatherUnroll; ++u) {
        const int f = b + u * NT + tid;
        if (f < total) {
          const int row = f / W;
          uint4* p = s_to[row];
          if (p != nullptr) p[f - row * W] = v[u];
        }
      }
    }
    if (tid == 0) bytes += static_cast<unsigned long long>(nok) * static_cast<unsigned>(W * 16);
    __syncthreads();  // s_from / s_to are rewritten by the next item
  }
  if (tid == 0 && a.moved != nullptr && bytes != 0) atomicAdd(a.moved, bytes);
}

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

cudaError_t launch_resolve(const ResolveArgs& a, int grid, size_t smem, cudaStream_t stream) {
  resolve_kernel<<<grid, kResolveThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t set_resolve_max_smem(int bytes) {
  return cudaFuncSetAttribute(resolve_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <int MAXL>
cudaError_t launch_gather(const GatherArgs<MAXL>& a, int grid, size_t smem, cudaStream_t stream) {
  gather_kernel<MAXL><<<grid, kGatherThreads, smem, stream>>>(a);
  return cudaGetLastError();
}
template cudaError_t launch_gather<kSmallGatherLayers>(const GatherArgs<kSmallGatherLayers>&, int,
                                                       size_t, cudaStream_t);
template cudaError_t launch_gather<kMaxGatherLayers>(const GatherArgs<kMaxGatherLayers>&, int,
                                                     size_t, cudaStream_t);

cudaError_t launch_invalidate(int32_t* slot_keys, int16_t* lru, const int32_t* state_rows,
                              const int32_t* keys, int64_t N, int64_t S, int H, int grid,
                              cudaStream_t stream) {
  invalidate_kernel<<<grid, kInvalidateThreads, 0, stream>>>(slot_keys, lru, state_rows, keys, N,
                                                             S, H);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace hisparse
