// CUDA backend of the hisparse ops: bit-identical to the C++ CPU reference (cpu_ops.cpp) and to
// docs/ops.md. No host synchronisation, no host reads of device data, fixed launch geometry
// (independent of device data), workspace from the caching allocator: every op can be captured
// in a CUDA graph and replayed with new inputs.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdint>
#include <string>

// The shared checks of validate.h are inline functions. Compiled here by nvcc's host pass and
// in cpu_ops.cpp by the host compiler, both copies would be weak symbols of one name that the
// linker merges, so one backend would run code compiled for the other. Keep this translation
// unit's copy apart in a private namespace (define HISPARSE_SHARED_VALIDATE_SYMBOLS to share).
#include <c10/util/Exception.h>

#include <vector>

#ifdef HISPARSE_SHARED_VALIDATE_SYMBOLS
#define HISPARSE_CUDA_OUTER_BEGIN
#define HISPARSE_CUDA_OUTER_END
#define HISPARSE_CUDA_NS ::hisparse
#else
#define HISPARSE_CUDA_OUTER_BEGIN namespace hisparse_cuda_private {
#define HISPARSE_CUDA_OUTER_END }
#define HISPARSE_CUDA_NS ::hisparse_cuda_private::hisparse
#endif

HISPARSE_CUDA_OUTER_BEGIN
#include "validate.h"

namespace hisparse {
namespace {

// ------------------------------------------------------------------------------------------------
// Shared helpers
// ------------------------------------------------------------------------------------------------

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

// Runs `fn` with the capture mode relaxed: host-side queries (pointer attributes, device
// attributes, function attributes) are then legal while another thread captures a graph.
template <typename Fn>
auto relaxed(Fn&& fn) {
  c10::cuda::CUDAStreamCaptureModeGuard g{cudaStreamCaptureModeRelaxed};
  return fn();
}

// A device attribute, queried once per device.
template <cudaDeviceAttr ATTR>
int device_attr(int device) {
  static std::atomic<int> cached[64];
  std::atomic<int>& slot = cached[device >= 0 && device < 64 ? device : 0];
  int v = slot.load(std::memory_order_relaxed);
  if (v == 0) {
    relaxed([&] {
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, ATTR, device));
      return 0;
    });
    slot.store(v, std::memory_order_relaxed);
  }
  return v;
}

int max_optin_smem(int device) {
  return device_attr<cudaDevAttrMaxSharedMemoryPerBlockOptin>(device);
}

int num_sms(int device) { return device_attr<cudaDevAttrMultiProcessorCount>(device); }

// ------------------------------------------------------------------------------------------------
// resolve_residency
// ------------------------------------------------------------------------------------------------

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

void resolve_residency_cuda(const at::Tensor& top_k, const at::Tensor& state_rows,
                            const c10::optional<at::Tensor>& resident_rows, at::Tensor& slot_keys,
                            at::Tensor& lru, at::Tensor& stats, at::Tensor& out_rows,
                            at::Tensor& miss_src, at::Tensor& miss_dst, at::Tensor& miss_count,
                            int64_t num_keys, int64_t hot_base) {
  const ResolveDims d =
      check_resolve_args(top_k, state_rows, resident_rows, slot_keys, lru, stats, out_rows,
                         miss_src, miss_dst, miss_count, num_keys, hot_base);
  TORCH_CHECK(top_k.is_cuda(), "hisparse_resolve_residency: argument 'top_k' must be on a CUDA ",
              "device for the CUDA backend, got ", top_k.device());
  TORCH_CHECK(d.B <= kInt32Max, "hisparse_resolve_residency: argument 'top_k' has more than ",
              "2^31-1 rows");
  if (d.B == 0) return;
  c10::cuda::CUDAGuard guard(top_k.device());
  const int device = top_k.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);

  const bool has_res = resident_rows.has_value() && resident_rows->defined();
  int cap_log2 = 1;
  while ((int64_t(1) << cap_log2) < 2 * d.K) ++cap_log2;
  const int64_t scratch = resolve_scratch_bytes(static_cast<int>(d.K), static_cast<int>(d.H),
                                                1 << cap_log2);

  ResolveArgs a;
  a.top_k = top_k.data_ptr<int32_t>();
  a.state_rows = state_rows.data_ptr<int32_t>();
  a.resident = has_res ? resident_rows->data_ptr<int32_t>() : nullptr;
  a.slot_keys = slot_keys.data_ptr<int32_t>();
  a.lru = lru.data_ptr<int16_t>();
  a.stats = reinterpret_cast<unsigned long long*>(stats.data_ptr<uint64_t>());
  a.out_rows = out_rows.data_ptr<int32_t>();
  a.miss_src = miss_src.data_ptr<int32_t>();
  a.miss_dst = miss_dst.data_ptr<int32_t>();
  a.miss_count = miss_count.data_ptr<int32_t>();
  a.B = static_cast<int>(d.B);
  a.K = static_cast<int>(d.K);
  a.S = static_cast<int>(std::min<int64_t>(d.S, kInt32Max));
  a.H = static_cast<int>(d.H);
  a.num_keys = static_cast<int>(num_keys);
  a.hot_base = static_cast<int>(hot_base);
  a.cap_log2 = cap_log2;

  // Static shared memory of the kernel (warp totals) plus a margin.
  const int64_t smem_limit = max_optin_smem(device) - 1024;
  if (scratch <= smem_limit) {
    a.workspace = nullptr;
    a.ws_stride = 0;
    if (scratch > 48 * 1024) {
      static std::atomic<int> raised[64];
      std::atomic<int>& cur = raised[device < 64 ? device : 0];
      if (cur.load(std::memory_order_relaxed) < scratch) {
        relaxed([&] {
          C10_CUDA_CHECK(cudaFuncSetAttribute(resolve_kernel,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem_limit)));
          return 0;
        });
        cur.store(static_cast<int>(smem_limit), std::memory_order_relaxed);
      }
    }
    const int grid = static_cast<int>(std::min<int64_t>(d.B, 1 << 20));
    resolve_kernel<<<grid, kResolveThreads, static_cast<size_t>(scratch), stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  } else {
    // Too large for shared memory (K and H in the tens of thousands): per-CTA scratch in
    // global memory, a bounded persistent grid walking the batch rows.
    const int grid = static_cast<int>(std::min<int64_t>(d.B, 2 * num_sms(device)));
    a.ws_stride = round16(scratch);
    at::Tensor ws = at::empty({grid * a.ws_stride}, top_k.options().dtype(at::kByte));
    a.workspace = ws.data_ptr<uint8_t>();
    resolve_kernel<<<grid, kResolveThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// ------------------------------------------------------------------------------------------------
// gather
// ------------------------------------------------------------------------------------------------

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

template <int MAXL>
void launch_gather(const GatherPlan& plan, const std::vector<const uint8_t*>& src_ptrs,
                   const at::Tensor& miss_src, const at::Tensor& miss_dst,
                   const at::Tensor& miss_count, unsigned long long* moved, int device,
                   cudaStream_t stream) {
  GatherArgs<MAXL> a;
  const int L = static_cast<int>(plan.host.size());
  for (int l = 0; l < MAXL; ++l) {
    GatherLayer g{};
    if (l < L) {
      const RowView& h = plan.host[l];
      const RowView& d = plan.hot[l];
      g.src = src_ptrs[l];
      g.dst = d.base;
      g.src_block_stride = h.block_stride;
      g.src_row_stride = h.row_stride;
      g.dst_block_stride = d.block_stride;
      g.dst_row_stride = d.row_stride;
      // A view with zero blocks has no rows; keep the divisor non-zero.
      g.src_block_size = static_cast<int32_t>(std::max<int64_t>(h.block_size, 1));
      g.dst_block_size = static_cast<int32_t>(std::max<int64_t>(d.block_size, 1));
      g.src_rows = static_cast<int32_t>(h.rows());
      g.dst_rows = static_cast<int32_t>(d.rows());
      g.words = static_cast<int32_t>(h.row_bytes / 16);
    }
    a.layer[l] = g;
  }
  a.moved = moved;
  a.K = static_cast<int>(plan.K);
  a.L = L;
  const int32_t* src = miss_src.data_ptr<int32_t>();
  const int32_t* dst = miss_dst.data_ptr<int32_t>();
  const int32_t* cnt = miss_count.data_ptr<int32_t>();
  const int64_t chunks_per_row = (plan.K + kGatherRows - 1) / kGatherRows;
  const int64_t max_grid = int64_t(num_sms(device)) * 8;
  for (int64_t r0 = 0; r0 < plan.B; r0 += kGatherMaxBatch) {
    const int Bc = static_cast<int>(std::min<int64_t>(kGatherMaxBatch, plan.B - r0));
    a.miss_src = src + r0 * plan.K;
    a.miss_dst = dst + r0 * plan.K;
    a.miss_count = cnt + r0;
    a.B = Bc;
    const int64_t upper = chunks_per_row * Bc * L;
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min(upper, max_grid)));
    const size_t smem = static_cast<size_t>(Bc + 1) * sizeof(int);
    gather_kernel<MAXL><<<grid, kGatherThreads, smem, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

void gather_cuda(at::TensorList host, at::TensorList hot, const at::Tensor& miss_src,
                 const at::Tensor& miss_dst, const at::Tensor& miss_count,
                 const c10::optional<at::Tensor>& moved_bytes) {
  const char* op = "hisparse_gather";
  // is_pinned() queries pointer attributes: relax the capture mode around it.
  const GatherPlan plan = relaxed([&] {
    return check_gather_args(
        host, hot, miss_src, miss_dst, miss_count, moved_bytes,
        [&](const at::Tensor& t, const std::string& name) {
          const at::Device dev = miss_src.device();
          const bool on_dev = t.is_cuda() && t.device() == dev;
          const bool pinned = t.device().is_cpu() && t.is_pinned();
          TORCH_CHECK(on_dev || pinned, op, ": argument '", name,
                      "' must be in pinned host memory or on ", dev,
                      " for the CUDA backend, got ", t.device(),
                      t.device().is_cpu() ? " (not pinned)" : "");
        });
  });
  TORCH_CHECK(miss_src.is_cuda(), op, ": argument 'miss_src' must be on a CUDA device for the ",
              "CUDA backend, got ", miss_src.device());
  const int64_t L = static_cast<int64_t>(plan.host.size());
  TORCH_CHECK(L <= kMaxGatherLayers, op, ": argument 'host' lists ", L,
              " views; the CUDA backend gathers at most ", kMaxGatherLayers,
              " member layers per call");
  TORCH_CHECK(plan.B <= kInt32Max, op, ": argument 'miss_src' has more than 2^31-1 rows");
  if (plan.B == 0) return;
  c10::cuda::CUDAGuard guard(miss_src.device());
  const int device = miss_src.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);

  // Device address of each host view: pinned memory is mapped (UVA); ask the driver for the
  // device alias and fall back to the host address (identical under UVA).
  std::vector<const uint8_t*> src_ptrs(L);
  for (int64_t l = 0; l < L; ++l) {
    const uint8_t* p = plan.host[l].base;
    if (host[l].device().is_cpu() && p != nullptr) {
      void* dp = nullptr;
      const cudaError_t e = relaxed([&] {
        return cudaHostGetDevicePointer(&dp, const_cast<uint8_t*>(p), 0);
      });
      if (e == cudaSuccess && dp != nullptr) {
        p = static_cast<const uint8_t*>(dp);
      } else {
        (void)cudaGetLastError();  // clear the sticky-free error; UVA address is used
      }
    }
    src_ptrs[l] = p;
  }
  unsigned long long* moved = nullptr;
  if (moved_bytes.has_value() && moved_bytes->defined())
    moved = reinterpret_cast<unsigned long long*>(moved_bytes->data_ptr<uint64_t>());
  if (L <= kSmallGatherLayers)
    launch_gather<kSmallGatherLayers>(plan, src_ptrs, miss_src, miss_dst, miss_count, moved,
                                      device, stream);
  else
    launch_gather<kMaxGatherLayers>(plan, src_ptrs, miss_src, miss_dst, miss_count, moved,
                                    device, stream);
}

// ------------------------------------------------------------------------------------------------
// invalidate
// ------------------------------------------------------------------------------------------------

constexpr int kInvalidateThreads = 256;

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

void invalidate_cuda(at::Tensor& slot_keys, at::Tensor& lru, const at::Tensor& state_rows,
                     const c10::optional<at::Tensor>& keys) {
  const InvalidateDims d = check_invalidate_args(slot_keys, lru, state_rows, keys);
  TORCH_CHECK(slot_keys.is_cuda(), "hisparse_invalidate: argument 'slot_keys' must be on a ",
              "CUDA device for the CUDA backend, got ", slot_keys.device());
  if (d.N == 0 || d.S == 0) return;
  c10::cuda::CUDAGuard guard(slot_keys.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(slot_keys.get_device());
  const bool by_key = keys.has_value() && keys->defined();
  const int grid = static_cast<int>(std::min<int64_t>(d.N, 1 << 16));
  invalidate_kernel<<<grid, kInvalidateThreads, 0, stream>>>(
      slot_keys.data_ptr<int32_t>(), lru.data_ptr<int16_t>(), state_rows.data_ptr<int32_t>(),
      by_key ? keys->data_ptr<int32_t>() : nullptr, d.N, d.S, static_cast<int>(d.H));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace hisparse
HISPARSE_CUDA_OUTER_END

TORCH_LIBRARY_IMPL(hisparse, CUDA, m) {
  m.impl("hisparse_resolve_residency", &HISPARSE_CUDA_NS::resolve_residency_cuda);
  m.impl("hisparse_gather", &HISPARSE_CUDA_NS::gather_cuda);
  m.impl("hisparse_invalidate", &HISPARSE_CUDA_NS::invalidate_cuda);
}
