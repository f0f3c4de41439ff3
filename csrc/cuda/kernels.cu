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

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// Copies `nbytes` (even) from global memory to 16-byte aligned scratch, block-wide. With
// `async` the scratch is shared memory and the copies are cp.async (the caller waits with
// cp_async_wait_all, then a barrier); otherwise plain loads and stores (global workspace).
template <int NT>
__device__ __forceinline__ void stage_copy(uint8_t* dst, const void* src_, int64_t nbytes,
                                           bool async) {
  const uint8_t* src = static_cast<const uint8_t*>(src_);
  const int tid = threadIdx.x;
  const uintptr_t sa = reinterpret_cast<uintptr_t>(src);
  int64_t done = 0;
  if ((sa & 15u) == 0) {
    const int64_t n = nbytes >> 4;
    for (int64_t i = tid; i < n; i += NT) {
      if (async)
        cp_async16(dst + 16 * i, src + 16 * i);
      else
        reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
    done = n << 4;
  } else if ((sa & 3u) == 0) {
    const int64_t n = nbytes >> 2;
    for (int64_t i = tid; i < n; i += NT) {
      if (async)
        cp_async4(dst + 4 * i, src + 4 * i);
      else
        reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
    }
    done = n << 2;
  }
  for (int64_t b = done + 2 * tid; b < nbytes; b += 2 * NT)
    *reinterpret_cast<int16_t*>(dst + b) = *reinterpret_cast<const int16_t*>(src + b);
}

// One CTA per batch row (a fixed grid walks the rows when the batch is larger than the grid).
// Per row: (0) every global read issued at once into scratch, (1) hash the selected keys,
// (2) find the hit slot of each key, (3) split the LRU order into evictable and hit slots,
// (4) number the misses and assign them evictable slots, (5) write outputs and the new order.
template <int NT>
__global__ void __launch_bounds__(NT, 1024 / NT) resolve_kernel(const ResolveArgs a) {
  constexpr int TILE = kResolveTile;
  constexpr int IT = TILE / NT;
  static_assert(IT * NT == TILE && (IT == 4 || IT == 8), "scan items per thread");
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ unsigned warp_tot[32];
  const int tid = threadIdx.x;
  const int K = a.K, H = a.H;
  const int cap = 1 << a.cap_log2;
  const int shift = 32 - a.cap_log2;
  const unsigned mask = static_cast<unsigned>(cap - 1);
  const bool has_res = a.resident != nullptr;
  const ResolveLayout lay(K, H, cap, has_res);
  uint8_t* base = a.workspace != nullptr ? a.workspace + int64_t(blockIdx.x) * a.ws_stride : smem;
  int* hkey = reinterpret_cast<int*>(base);
  unsigned* hfs = reinterpret_cast<unsigned*>(hkey + cap);  // first << 16 | slot
  int* hidx = reinterpret_cast<int*>(base + lay.entries);  // key, then hash index / -1 / -2
  int* sres = reinterpret_cast<int*>(base + lay.resident);
  int* sslot = reinterpret_cast<int*>(base + lay.slots);  // slot key, then its hash index / -1
  int16_t* sorder = reinterpret_cast<int16_t*>(base + lay.order);
  int16_t* list = reinterpret_cast<int16_t*>(base + lay.list);

  for (int r = blockIdx.x; r < a.B; r += gridDim.x) {
    // 0. Stage the row: keys, resident rows, slot keys and LRU order, all copies in flight
    //    together (cp.async straight into shared memory). The keys go first: they do not
    //    depend on the state row, so their load overlaps the read of state_rows[r]. The
    //    duplicate-state-row check (rule 0) and clearing the hash overlap the copies.
    const bool async = a.workspace == nullptr;
    const int32_t* keys = a.top_k + int64_t(r) * K;
    const int32_t* res = has_res ? a.resident + int64_t(r) * K : nullptr;
    stage_copy<NT>(reinterpret_cast<uint8_t*>(hidx), keys, int64_t(K) * 4, async);
    if (has_res) stage_copy<NT>(reinterpret_cast<uint8_t*>(sres), res, int64_t(K) * 4, async);
    const int s = a.state_rows[r];
    const bool in_range = s >= 0 && s < a.S;
    int32_t* out = a.out_rows + int64_t(r) * K;
    int32_t* sk = a.slot_keys + int64_t(in_range ? s : 0) * H;
    int16_t* order = a.lru + int64_t(in_range ? s : 0) * H;
    bool dup = false;
    if (in_range) {
      stage_copy<NT>(reinterpret_cast<uint8_t*>(sslot), sk, int64_t(H) * 4, async);
      stage_copy<NT>(reinterpret_cast<uint8_t*>(sorder), order, int64_t(H) * 2, async);
      for (int q = tid; q < r; q += NT) dup |= a.state_rows[q] == s;
      for (int j = tid; j < cap / 4; j += NT) {  // cap >= 4
        reinterpret_cast<int4*>(hkey)[j] = make_int4(-1, -1, -1, -1);
        reinterpret_cast<uint4*>(hfs)[j] = make_uint4(~0u, ~0u, ~0u, ~0u);
      }
    }
    if (async) cp_async_wait_all();
    const bool live = in_range && !__syncthreads_or(dup);
    if (!live) {  // padding row: rule 0
      for (int i = tid; i < K; i += NT) out[i] = -1;
      if (tid == 0) a.miss_count[r] = 0;
      continue;  // the staged keys are not read; the next row restages after this barrier
    }
    int32_t* msrc = a.miss_src + int64_t(r) * K;
    int32_t* mdst = a.miss_dst + int64_t(r) * K;
    const int row_base = a.hot_base + s * H;

    // 1. Hash the selected keys; first occurrence by atomicMin (rules 1-3). Padding and
    //    resident entries get their final output now.
    for (int i = tid; i < K; i += NT) {
      const int k = hidx[i];
      int idx;
      if (k < 0 || k >= a.num_keys) {
        idx = -1;
        out[i] = -1;
      } else if (has_res && sres[i] >= 0) {
        idx = -2;
        out[i] = sres[i];
      } else {
        unsigned h = hash_slot(k, shift);
        while (true) {
          const int old = atomicCAS(&hkey[h], -1, k);
          if (old == -1 || old == k) break;
          h = (h + 1) & mask;
        }
        atomicMin(&hfs[h], (static_cast<unsigned>(i) << 16) | kNone16);
        idx = static_cast<int>(h);
      }
      hidx[i] = idx;
    }
    __syncthreads();

    // 2. Hits: the lowest slot holding a selected key. Each slot remembers its key's hash index.
    for (int j = tid; j < H; j += NT) {
      const int k = sslot[j];
      int found = -1;
      if (k >= 0) {  // the hash holds keys >= 0 only
        unsigned h = hash_slot(k, shift);
        while (true) {
          const int hk = hkey[h];
          if (hk == k) {
            // the first-occurrence half is final (phase 1); only the slot half is lowered
            atomicMin(&hfs[h], (hfs[h] & 0xFFFF0000u) | static_cast<unsigned>(j));
            found = static_cast<int>(h);
            break;
          }
          if (hk == -1) break;
          h = (h + 1) & mask;
        }
      }
      sslot[j] = found;
    }
    __syncthreads();

    // 3. Walk the LRU order: evictable slots to list[0..E), hit slots to list[H-1..H-NH]
    //    (both in LRU order). A slot is a hit slot iff it is the hit slot of its own key.
    //    Packed counters: low 16 bits evictable, high 16 bits hits.
    static_assert(kMaxHotSize <= 0xFFFF, "E + NH <= H must not carry out of the low half");
    unsigned carry = 0;
    for (int t0 = 0; t0 < H; t0 += TILE) {
      const int p0 = t0 + tid * IT;
      int16_t sl[IT];
      if (p0 < H) {
        if constexpr (IT == 8) {
          const uint4 w = *reinterpret_cast<const uint4*>(sorder + p0);
          const int16_t* wv = reinterpret_cast<const int16_t*>(&w);
#pragma unroll
          for (int k = 0; k < IT; ++k) sl[k] = wv[k];
        } else {
          const uint2 w = *reinterpret_cast<const uint2*>(sorder + p0);
          const int16_t* wv = reinterpret_cast<const int16_t*>(&w);
#pragma unroll
          for (int k = 0; k < IT; ++k) sl[k] = wv[k];
        }
      }
      unsigned f[IT];
      unsigned local = 0;
#pragma unroll
      for (int k = 0; k < IT; ++k) {
        unsigned v = 0;
        const int x = sl[k];
        if (p0 + k < H && x >= 0 && x < H) {
          const int h = sslot[x];
          v = (h >= 0 && (hfs[h] & kNone16) == static_cast<unsigned>(x)) ? 0x10000u : 1u;
        }
        f[k] = v;
        local += v;
      }
      unsigned tot;
      unsigned run = carry + block_exclusive_scan<NT>(local, warp_tot, &tot);
#pragma unroll
      for (int k = 0; k < IT; ++k) {
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
    for (int t0 = 0; t0 < K; t0 += TILE) {
      const int i0 = t0 + tid * IT;
      int hv[IT];
      if (i0 < K) {
#pragma unroll
        for (int q = 0; q < IT; q += 4) {
          const int4 w = *reinterpret_cast<const int4*>(hidx + i0 + q);
          hv[q] = w.x;
          hv[q + 1] = w.y;
          hv[q + 2] = w.z;
          hv[q + 3] = w.w;
        }
      }
      unsigned f[IT];
      unsigned local = 0;
#pragma unroll
      for (int k = 0; k < IT; ++k) {
        unsigned v = 0;
        if (i0 + k < K) {
          const int h = hv[k];
          if (h >= 0) {
            const unsigned e = hfs[h];
            if ((e >> 16) == static_cast<unsigned>(i0 + k))
              v = (e & kNone16) == kNone16 ? 1u : 0x10000u;
          }
        }
        f[k] = v;
        local += v;
      }
      unsigned tot;
      unsigned run = carry + block_exclusive_scan<NT>(local, warp_tot, &tot);
#pragma unroll
      for (int k = 0; k < IT; ++k) {
        if (f[k] == 1u) {
          const int m = static_cast<int>(run & 0xFFFFu);
          if (m < E) {  // otherwise no evictable slot is left (corrupted LRU only)
            const int h = hv[k];
            const int slot = list[m];
            const int key = hkey[h];
            // only the first occurrence's thread writes hfs[h] here; the others read only its
            // first-occurrence half, which does not change
            hfs[h] = (hfs[h] & 0xFFFF0000u) | static_cast<unsigned>(slot);
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

    // 5. Outputs of hot entries (rule 6); padding and resident entries were written in 1.
    for (int i = tid; i < K; i += NT) {
      const int h = hidx[i];
      if (h >= 0) {
        const unsigned sl = hfs[h] & kNone16;
        out[i] = sl == kNone16 ? -1 : row_base + static_cast<int>(sl);
      }
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

// Rows are moved as uint4 words, so the row alignment validate.h enforces must be one word.
static_assert(kRowAlign == sizeof(uint4), "row alignment must equal the copy word");

// Row copies for gather (host -> hot) and save_rows (device -> host). Work items are
// (layer, batch row, chunk of C = 1 << chunk_log2 planned rows); each warp of a fixed grid walks
// them. Every CTA recomputes the per-row chunk prefix from the counts (a few KB, from L2), so the
// grid never depends on device data and no warp sits idle on an empty row. A row is moved in
// 16-byte words laid on the 128-byte lines of its host-side address: lane j of access p takes
// word p*32 + j - shift, where shift is the row's word offset inside its first line, so each
// line of the row is requested by exactly one warp-wide access.
template <int MAXL>
__global__ void __launch_bounds__(kCopyThreads)
    copy_rows_kernel(const __grid_constant__ CopyArgs<MAXL> a) {
  constexpr int NT = kCopyThreads;
  constexpr int NW = kCopyWarps;
  constexpr int U = kCopyUnroll;
  extern __shared__ int chunk_start[];  // [B + 1]
  __shared__ unsigned warp_tot[32];
  __shared__ const uint4* s_from[NW][32];
  __shared__ uint4* s_to[NW][32];
  __shared__ int s_shift[NW][32];
  __shared__ unsigned long long s_bytes[NW];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int C = 1 << a.chunk_log2;

  unsigned carry = 0;
  for (int r0 = 0; r0 < a.B; r0 += NT) {
    const int r = r0 + tid;
    unsigned c = 0;
    if (r < a.B) {
      const int n = a.count != nullptr ? min(max(a.count[r], 0), a.K) : a.K;
      c = static_cast<unsigned>((n + C - 1) >> a.chunk_log2);
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
  for (int64_t w = int64_t(blockIdx.x) * NW + warp; w < work; w += int64_t(gridDim.x) * NW) {
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
    const int n = a.count != nullptr ? min(max(a.count[r], 0), a.K) : a.K;
    const int m0 = (q - chunk_start[r]) << a.chunk_log2;
    const int rows = min(C, n - m0);
    const CopyLayer& L = a.layer[l];
    const int W = L.words;
    bool ok = false;
    if (lane < rows) {
      const int64_t idx = int64_t(r) * a.K + m0 + lane;
      const int s = a.src_idx[idx];
      const int t = a.dst_idx[idx];
      ok = s >= 0 && s < L.src_rows && t >= 0 && t < L.dst_rows;
      const uint8_t* from = nullptr;
      uint8_t* to = nullptr;
      int sh = 0;
      if (ok) {
        from = L.src + int64_t(s / L.src_block_size) * L.src_block_stride +
               int64_t(s % L.src_block_size) * L.src_row_stride;
        to = L.dst + int64_t(t / L.dst_block_size) * L.dst_block_stride +
             int64_t(t % L.dst_block_size) * L.dst_row_stride;
        sh = static_cast<int>((reinterpret_cast<uintptr_t>(a.align_dst ? to : from) & 127u) >> 4);
      }
      s_from[warp][lane] = reinterpret_cast<const uint4*>(from);
      s_to[warp][lane] = reinterpret_cast<uint4*>(to);
      s_shift[warp][lane] = sh;
    }
    const unsigned okmask = __ballot_sync(0xffffffffu, ok);
    __syncwarp();
    bytes += static_cast<unsigned long long>(__popc(okmask)) * static_cast<unsigned>(W * 16);
    const int P = L.parts;
    const int units = rows * P;
    for (int u0 = 0; u0 < units; u0 += U) {
      int row = u0 / P, part = u0 - row * P;
      uint4 v[U];
      int off[U];
      int rw[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        rw[u] = -1;
        off[u] = 0;
        v[u] = make_uint4(0u, 0u, 0u, 0u);
        if (u0 + u < units) {
          const uint4* p = s_from[warp][row];
          const int k = part * 32 + lane - s_shift[warp][row];
          if (p != nullptr && k >= 0 && k < W) {
            v[u] = __ldcs(p + k);
            rw[u] = row;
            off[u] = k;
          }
        }
        if (++part == P) {
          part = 0;
          ++row;
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
        if (rw[u] >= 0) s_to[warp][rw[u]][off[u]] = v[u];
    }
    __syncwarp();  // s_from / s_to / s_shift of this warp are rewritten by its next item
  }
  if (lane == 0) s_bytes[warp] = bytes;
  __syncthreads();
  if (tid == 0 && a.moved != nullptr) {
    unsigned long long total = 0;
    for (int i = 0; i < NW; ++i) total += s_bytes[i];
    if (total != 0) atomicAdd(a.moved, total);
  }
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

cudaError_t launch_resolve(const ResolveArgs& a, bool wide, int grid, size_t smem,
                           cudaStream_t stream) {
  if (wide)
    resolve_kernel<kResolveThreadsWide><<<grid, kResolveThreadsWide, smem, stream>>>(a);
  else
    resolve_kernel<kResolveThreads><<<grid, kResolveThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t set_resolve_max_smem(int bytes) {
  cudaError_t e = cudaFuncSetAttribute(resolve_kernel<kResolveThreads>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return e;
  return cudaFuncSetAttribute(resolve_kernel<kResolveThreadsWide>,
                              cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <int MAXL>
cudaError_t launch_copy(const CopyArgs<MAXL>& a, int grid, size_t smem, cudaStream_t stream) {
  copy_rows_kernel<MAXL><<<grid, kCopyThreads, smem, stream>>>(a);
  return cudaGetLastError();
}
template cudaError_t launch_copy<kSmallCopyLayers>(const CopyArgs<kSmallCopyLayers>&, int,
                                                   size_t, cudaStream_t);
template cudaError_t launch_copy<kMaxCopyLayers>(const CopyArgs<kMaxCopyLayers>&, int, size_t,
                                                 cudaStream_t);

int copy_blocks_per_sm(bool many_layers) {
  int n = 0;
  const cudaError_t e =
      many_layers
          ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, copy_rows_kernel<kMaxCopyLayers>,
                                                          kCopyThreads, 8 * 1024)
          : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, copy_rows_kernel<kSmallCopyLayers>,
                                                          kCopyThreads, 8 * 1024);
  return e == cudaSuccess && n > 0 ? n : 4;
}

cudaError_t launch_invalidate(int32_t* slot_keys, int16_t* lru, const int32_t* state_rows,
                              const int32_t* keys, int64_t N, int64_t S, int H, int grid,
                              cudaStream_t stream) {
  invalidate_kernel<<<grid, kInvalidateThreads, 0, stream>>>(slot_keys, lru, state_rows, keys, N,
                                                             S, H);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace hisparse
