// CUDA backend entry points: validation (validate.h, shared with the CPU backend), tensors to
// raw pointers, launches on the current stream, registration. Kernels are in kernels.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#include "kernels.cuh"
#include "validate.h"

namespace hisparse {
namespace {

using namespace ::hisparse::cuda;

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
          C10_CUDA_CHECK(set_resolve_max_smem(static_cast<int>(smem_limit)));
          return 0;
        });
        cur.store(static_cast<int>(smem_limit), std::memory_order_relaxed);
      }
    }
    const int grid = static_cast<int>(std::min<int64_t>(d.B, 1 << 20));
    C10_CUDA_CHECK(launch_resolve(a, grid, static_cast<size_t>(scratch), stream));
  } else {
    // Too large for shared memory (K and H in the tens of thousands): per-CTA scratch in
    // global memory, a bounded persistent grid walking the batch rows.
    const int grid = static_cast<int>(std::min<int64_t>(d.B, 2 * num_sms(device)));
    a.ws_stride = round16(scratch);
    at::Tensor ws = at::empty({grid * a.ws_stride}, top_k.options().dtype(at::kByte));
    a.workspace = ws.data_ptr<uint8_t>();
    C10_CUDA_CHECK(launch_resolve(a, grid, 0, stream));
  }
}

template <int MAXL>
void gather_launches(const GatherPlan& plan, const std::vector<const uint8_t*>& src_ptrs,
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
    C10_CUDA_CHECK(launch_gather<MAXL>(a, grid, smem, stream));
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
    gather_launches<kSmallGatherLayers>(plan, src_ptrs, miss_src, miss_dst, miss_count, moved,
                                      device, stream);
  else
    gather_launches<kMaxGatherLayers>(plan, src_ptrs, miss_src, miss_dst, miss_count, moved,
                                    device, stream);
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
  C10_CUDA_CHECK(launch_invalidate(
      slot_keys.data_ptr<int32_t>(), lru.data_ptr<int16_t>(), state_rows.data_ptr<int32_t>(),
      by_key ? keys->data_ptr<int32_t>() : nullptr, d.N, d.S, static_cast<int>(d.H), grid, stream));
}

}  // namespace
}  // namespace hisparse

TORCH_LIBRARY_IMPL(hisparse, CUDA, m) {
  m.impl("hisparse_resolve_residency", &hisparse::resolve_residency_cuda);
  m.impl("hisparse_gather", &hisparse::gather_cuda);
  m.impl("hisparse_invalidate", &hisparse::invalidate_cuda);
}
