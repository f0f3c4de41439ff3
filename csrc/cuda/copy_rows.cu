// The row-copy kernel of gather (host -> hot) and save_rows (device -> host): one kernel for
// both ops, so it lives in one file. Bit-identical to cpu_ops.cpp and docs/ops.md; fixed launch
// geometry, no host reads of device data: graph-capturable.
#include "common.cuh"
#include "kernels.cuh"

namespace hisparse {
namespace cuda {
namespace {

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

}  // namespace

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

}  // namespace cuda
}  // namespace hisparse
