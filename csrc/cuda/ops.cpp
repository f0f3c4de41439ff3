// CUDA backend entry points: validation (validate.h, shared with the CPU backend), tensors to
// raw pointers, launches on the current stream, registration. The kernels are one file per op:
// resolve_residency.cu, copy_rows.cu (gather and save_rows), invalidate.cu and topk_slots.cu.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <atomic>
#include <mutex>
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
                            const c10::Scalar& num_keys, const c10::Scalar& hot_base) {
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
  const int K = static_cast<int>(d.K), H = static_cast<int>(d.H);
  // One wide CTA per row while the batch fits one CTA per multiprocessor; otherwise two
  // narrower CTAs per multiprocessor. The hash gets as many entries (up to 8 per key) as the
  // shared memory of the CTAs sharing a multiprocessor allows: a sparser hash has shorter
  // probe chains, and the probes are most of resolve's work.
  const bool wide = d.B <= num_sms(device);
  const int64_t smem_limit = max_optin_smem(device) - 1024;
  const int64_t per_sm = device_attr<cudaDevAttrMaxSharedMemoryPerMultiprocessor>(device);
  // less the driver's 1 KB per block and the kernel's static shared memory
  const int64_t per_cta = std::min<int64_t>(smem_limit, per_sm / (wide ? 1 : 2) - 2048);
  int cap_log2 = 2;
  while ((int64_t(1) << cap_log2) < 2 * d.K) ++cap_log2;
  while ((int64_t(1) << (cap_log2 + 1)) <= kResolveMaxCapPerKey * d.K &&
         ResolveLayout(K, H, 1 << (cap_log2 + 1), has_res).total <= per_cta)
    ++cap_log2;
  const int64_t scratch = ResolveLayout(K, H, 1 << cap_log2, has_res).total;

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
  a.K = K;
  a.S = static_cast<int>(std::min<int64_t>(d.S, kInt32Max));
  a.H = H;
  a.num_keys = static_cast<int>(d.num_keys);
  a.hot_base = static_cast<int>(d.hot_base);
  a.cap_log2 = cap_log2;

  if (scratch <= smem_limit) {
    a.workspace = nullptr;
    a.ws_stride = 0;
    if (scratch > 48 * 1024) {
      static std::atomic<int> raised[64];
      std::atomic<int>& cur = raised[device >= 0 && device < 64 ? device : 0];
      if (cur.load(std::memory_order_relaxed) < scratch) {
        relaxed([&] {
          C10_CUDA_CHECK(set_resolve_max_smem(static_cast<int>(smem_limit)));
          return 0;
        });
        cur.store(static_cast<int>(smem_limit), std::memory_order_relaxed);
      }
    }
    const int grid = static_cast<int>(std::min<int64_t>(d.B, 1 << 20));
    C10_CUDA_CHECK(launch_resolve(a, wide, grid, static_cast<size_t>(scratch), stream));
  } else {
    // Too large for shared memory (K or H in the tens of thousands): per-CTA scratch in
    // global memory, a bounded persistent grid walking the batch rows.
    const int grid = static_cast<int>(std::min<int64_t>(d.B, 2 * num_sms(device)));
    a.ws_stride = round16(scratch);
    at::Tensor ws = at::empty({grid * a.ws_stride}, top_k.options().dtype(at::kByte));
    a.workspace = ws.data_ptr<uint8_t>();
    C10_CUDA_CHECK(launch_resolve(a, false, grid, 0, stream));
  }
}

// One planned row copy between two row views per (batch row, planned row, layer): the shared
// launch path of gather (host -> hot) and save_rows (device -> host). Layers are launched in
// groups of at most kMaxCopyLayers, batch rows in groups of at most kCopyMaxBatch.
struct CopyPlan {
  std::vector<RowView> src, dst;
  std::vector<const uint8_t*> src_ptr;  // device-visible addresses
  std::vector<uint8_t*> dst_ptr;
  const int32_t* src_idx;
  const int32_t* dst_idx;
  const int32_t* count;  // nullptr: every planned row
  int64_t B, K;
  bool align_dst;
  bool over_pcie = false;  // a host view in pinned host memory
};

// kPcieCopyCtas, or HISPARSE_PCIE_COPY_CTAS where set (read once).
int pcie_copy_ctas() {
  static const int ctas = [] {
    const char* s = std::getenv("HISPARSE_PCIE_COPY_CTAS");
    if (s == nullptr || *s == '\0') return kPcieCopyCtas;
    char* end = nullptr;
    const long n = std::strtol(s, &end, 10);
    TORCH_CHECK(end != s && *end == '\0' && n >= 0 && n <= (1 << 20),
                "HISPARSE_PCIE_COPY_CTAS must be a whole number from 0 (no cap) to 2^20, got '",
                s, "'");
    return static_cast<int>(n);
  }();
  return ctas;
}

int copy_blocks(int device, bool many) {
  static std::atomic<int> cached[2][64];
  std::atomic<int>& slot = cached[many ? 1 : 0][device >= 0 && device < 64 ? device : 0];
  int v = slot.load(std::memory_order_relaxed);
  if (v == 0) {
    v = relaxed([&] { return copy_blocks_per_sm(many); });
    slot.store(v, std::memory_order_relaxed);
  }
  return v;
}

template <int MAXL>
void copy_launches(const CopyPlan& plan, int64_t l0, int64_t L, unsigned long long* moved,
                   int device, cudaStream_t stream) {
  CopyArgs<MAXL> a;
  for (int l = 0; l < MAXL; ++l) {
    CopyLayer g{};
    if (l < L) {
      const RowView& s = plan.src[l0 + l];
      const RowView& d = plan.dst[l0 + l];
      g.src = plan.src_ptr[l0 + l];
      g.dst = plan.dst_ptr[l0 + l];
      g.src_block_stride = s.block_stride;
      g.src_row_stride = s.row_stride;
      g.dst_block_stride = d.block_stride;
      g.dst_row_stride = d.row_stride;
      // A view with zero blocks has no rows; keep the divisor non-zero.
      g.src_block_size = static_cast<int32_t>(std::max<int64_t>(s.block_size, 1));
      g.dst_block_size = static_cast<int32_t>(std::max<int64_t>(d.block_size, 1));
      g.src_rows = static_cast<int32_t>(s.rows());
      g.dst_rows = static_cast<int32_t>(d.rows());
      g.words = static_cast<int32_t>(s.row_bytes / kRowAlign);
      g.parts = static_cast<int32_t>((g.words + 7 + 31) / 32);
    }
    a.layer[l] = g;
  }
  a.moved = moved;
  a.K = static_cast<int>(plan.K);
  a.L = static_cast<int>(L);
  a.align_dst = plan.align_dst ? 1 : 0;
  int64_t max_grid = int64_t(num_sms(device)) * copy_blocks(device, MAXL > kSmallCopyLayers);
  if (plan.over_pcie && pcie_copy_ctas() > 0)
    max_grid = std::min<int64_t>(max_grid, pcie_copy_ctas());
  const int64_t resident_warps = max_grid * kCopyWarps;
  for (int64_t r0 = 0; r0 < plan.B; r0 += kCopyMaxBatch) {
    const int Bc = static_cast<int>(std::min<int64_t>(kCopyMaxBatch, plan.B - r0));
    a.src_idx = plan.src_idx + r0 * plan.K;
    a.dst_idx = plan.dst_idx + r0 * plan.K;
    a.count = plan.count != nullptr ? plan.count + r0 : nullptr;
    a.B = Bc;
    // Rows per work item from the largest possible plan: small plans get one row per warp
    // (every row in flight at once), large ones up to 8 (fewer plan reads per row).
    const int64_t upper_rows = int64_t(Bc) * plan.K * L;
    int chunk_log2 = 0;
    while (chunk_log2 < 3 && (upper_rows >> (chunk_log2 + 1)) >= 2 * resident_warps) ++chunk_log2;
    a.chunk_log2 = chunk_log2;
    const int64_t items = int64_t(Bc) * ((plan.K + (1 << chunk_log2) - 1) >> chunk_log2) * L;
    const int grid = static_cast<int>(
        std::max<int64_t>(1, std::min((items + kCopyWarps - 1) / kCopyWarps, max_grid)));
    const size_t smem = static_cast<size_t>(Bc + 1) * sizeof(int);
    C10_CUDA_CHECK(launch_copy<MAXL>(a, grid, smem, stream));
  }
}

void copy_rows(const CopyPlan& plan, unsigned long long* moved, int device, cudaStream_t stream) {
  const int64_t L = static_cast<int64_t>(plan.src.size());
  for (int64_t l0 = 0; l0 < L; l0 += kMaxCopyLayers) {
    const int64_t n = std::min<int64_t>(kMaxCopyLayers, L - l0);
    if (n <= kSmallCopyLayers)
      copy_launches<kSmallCopyLayers>(plan, l0, n, moved, device, stream);
    else
      copy_launches<kMaxCopyLayers>(plan, l0, n, moved, device, stream);
  }
}

// The device-visible address of a row view in pinned host memory (or on the device). Where the
// device can use host pointers of registered memory (UVA, every x86 system we run on) that is
// the host address itself and no runtime call is made; otherwise ask the runtime, and leave the
// thread's CUDA error state as it was before (an unrelated pending error stays pending).
const uint8_t* device_address(const at::Tensor& t, uint8_t* p, int device, const char* op,
                              const std::string& name) {
  if (!t.device().is_cpu() || p == nullptr) return p;
  if (device_attr<cudaDevAttrCanUseHostPointerForRegisteredMem>(device) == 1) return p;
  void* dp = nullptr;
  const cudaError_t before = cudaPeekAtLastError();
  const cudaError_t e = relaxed([&] { return cudaHostGetDevicePointer(&dp, p, 0); });
  if (e != cudaSuccess && before == cudaSuccess) (void)cudaGetLastError();  // ours only
  TORCH_CHECK(e == cudaSuccess && dp != nullptr, op, ": argument '", name,
              "' is pinned but has no device mapping (", cudaGetErrorString(e), ")");
  return static_cast<const uint8_t*>(dp);
}

// Fills in the device-visible addresses (the host side is `cp.dst` when `cp.align_dst`, else
// `cp.src`) and launches on the current stream of `index`'s device.
void run_copy(CopyPlan& cp, at::TensorList host, const at::Tensor& index,
              const c10::optional<at::Tensor>& moved_bytes, const char* op) {
  c10::cuda::CUDAGuard guard(index.device());
  const int device = index.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  const bool host_is_dst = cp.align_dst;
  for (size_t l = 0; l < cp.src.size(); ++l) {
    cp.over_pcie = cp.over_pcie || host[l].device().is_cpu();
    uint8_t* h = host_is_dst ? cp.dst[l].base : cp.src[l].base;
    uint8_t* h_dev = const_cast<uint8_t*>(
        device_address(host[l], h, device, op, "host[" + std::to_string(l) + "]"));
    cp.src_ptr.push_back(host_is_dst ? cp.src[l].base : h_dev);
    cp.dst_ptr.push_back(host_is_dst ? h_dev : cp.dst[l].base);
  }
  unsigned long long* moved = nullptr;
  if (moved_bytes.has_value() && moved_bytes->defined())
    moved = reinterpret_cast<unsigned long long*>(moved_bytes->data_ptr<uint64_t>());
  copy_rows(cp, moved, device, stream);
}

// Host views: pinned host memory or the plan's CUDA device.
void check_host_side(const at::Tensor& t, const std::string& name, const at::Device& dev,
                     const char* op) {
  const bool on_dev = t.is_cuda() && t.device() == dev;
  const bool pinned = t.device().is_cpu() && t.is_pinned();
  TORCH_CHECK(on_dev || pinned, op, ": argument '", name,
              "' must be in pinned host memory or on ", dev, " for the CUDA backend, got ",
              t.device(), t.device().is_cpu() ? " (not pinned)" : "");
}

void gather_cuda(at::TensorList host, at::TensorList hot, const at::Tensor& miss_src,
                 const at::Tensor& miss_dst, const at::Tensor& miss_count,
                 const c10::optional<at::Tensor>& moved_bytes) {
  const char* op = "hisparse_gather";
  // is_pinned() queries pointer attributes: relax the capture mode around it.
  const GatherPlan plan = relaxed([&] {
    return check_gather_args(host, hot, miss_src, miss_dst, miss_count, moved_bytes,
                             [&](const at::Tensor& t, const std::string& name) {
                               check_host_side(t, name, miss_src.device(), op);
                             });
  });
  TORCH_CHECK(miss_src.is_cuda(), op, ": argument 'miss_src' must be on a CUDA device for the ",
              "CUDA backend, got ", miss_src.device());
  TORCH_CHECK(plan.B <= kInt32Max, op, ": argument 'miss_src' has more than 2^31-1 rows");
  if (plan.B == 0 || plan.K == 0) return;
  CopyPlan cp;
  cp.src = plan.host;
  cp.dst = plan.hot;
  cp.src_idx = miss_src.data_ptr<int32_t>();
  cp.dst_idx = miss_dst.data_ptr<int32_t>();
  cp.count = miss_count.data_ptr<int32_t>();
  cp.B = plan.B;
  cp.K = plan.K;
  cp.align_dst = false;
  run_copy(cp, host, miss_src, moved_bytes, op);
}

void save_rows_cuda(at::TensorList src, at::TensorList host, const at::Tensor& src_rows,
                    const at::Tensor& host_rows, const c10::optional<at::Tensor>& moved_bytes) {
  const char* op = "hisparse_save_rows";
  const SavePlan plan = relaxed([&] {
    return check_save_args(src, host, src_rows, host_rows, moved_bytes,
                           [&](const at::Tensor& t, const std::string& name) {
                             check_host_side(t, name, src_rows.device(), op);
                           });
  });
  TORCH_CHECK(src_rows.is_cuda(), op, ": argument 'src_rows' must be on a CUDA device for the ",
              "CUDA backend, got ", src_rows.device());
  if (plan.N == 0) return;
  CopyPlan cp;
  cp.src = plan.src;
  cp.dst = plan.host;
  cp.src_idx = src_rows.data_ptr<int32_t>();
  cp.dst_idx = host_rows.data_ptr<int32_t>();
  cp.count = nullptr;
  cp.B = 1;
  cp.K = plan.N;
  cp.align_dst = true;  // the host side is the destination
  run_copy(cp, host, src_rows, moved_bytes, op);
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

// What the top-k kernel may use on this device, found once: whether it may hold a slice's keys
// in shared memory (its limit raised: a host call, legal inside a capture in relaxed mode) and,
// per cluster size, how many clusters run at once.
struct TopkDevice {
  bool cache = false;
  int active[kTopkMaxCluster + 1] = {};
};

const TopkDevice& topk_device(int device) {
  static TopkDevice devices[64];
  static std::once_flag once[64];
  const int i = device >= 0 && device < 64 ? device : 0;
  std::call_once(once[i], [&] {
    relaxed([&] {
      TopkDevice& d = devices[i];
      d.cache =
          max_optin_smem(device) >= kTopkSmemBytes && topk_slots_allow_cache() == cudaSuccess;
      cudaGetLastError();  // a refusal is not an error of the next launch
      const size_t smem = d.cache ? size_t(kTopkCacheRows) * sizeof(uint32_t) : 0;
      for (int c = 1; c <= kTopkMaxCluster; ++c) d.active[c] = topk_slots_active_clusters(c, smem);
      cudaGetLastError();
      return 0;
    });
  });
  return devices[i];
}

// CTAs per token: the largest cluster with which every token's cluster runs at once, but no
// slice under kTopkMinSlice positions. (On an H200 one token's 32k / 128k scores took 22 / 33 us
// over eight CTAs against 50 / 162 in one; 64 tokens' took 36 / 106 over two against 50 / 169
// in one, and 58 / 131 over three, which did not all run at once.)
int topk_cluster(int64_t T, int64_t L, const TopkDevice& dev) {
  constexpr int64_t kTopkMinSlice = 2048;
  const int64_t most = std::min<int64_t>(kTopkMaxCluster, std::max<int64_t>(1, L / kTopkMinSlice));
  for (int64_t c = most; c > 1; --c)
    if (T <= int64_t(dev.active[c])) return static_cast<int>(c);
  return 1;
}

void topk_slots_cuda(const at::Tensor& scores, const at::Tensor& req,
                     const at::Tensor& block_table, const c10::Scalar& block_size,
                     at::Tensor& out) {
  const TopkSlotsDims d = check_topk_slots_args(scores, req, block_table, block_size, out);
  TORCH_CHECK(scores.is_cuda(), "hisparse_topk_slots: argument 'scores' must be on a CUDA ",
              "device for the CUDA backend, got ", scores.device());
  TORCH_CHECK(d.T <= kInt32Max, "hisparse_topk_slots: argument 'scores' has more than 2^31-1 ",
              "rows");
  if (d.T == 0 || d.K == 0) return;
  c10::cuda::CUDAGuard guard(scores.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(scores.get_device());
  const bool req64 = req.scalar_type() == at::kLong, bt64 = block_table.scalar_type() == at::kLong;
  TopkSlotsArgs a{};
  a.scores = scores.data_ptr<float>();
  a.req64 = req64 ? req.data_ptr<int64_t>() : nullptr;
  a.req32 = req64 ? nullptr : req.data_ptr<int32_t>();
  a.bt64 = bt64 ? block_table.data_ptr<int64_t>() : nullptr;
  a.bt32 = bt64 ? nullptr : block_table.data_ptr<int32_t>();
  a.out = out.data_ptr<int64_t>();
  a.T = d.T, a.L = d.L, a.ld = d.ld, a.K = d.K, a.R = d.R, a.W = d.W;
  a.block_size = d.block_size;
  a.vec = d.ld % 4 == 0 && reinterpret_cast<uintptr_t>(a.scores) % 16 == 0;
  const int device = scores.get_device();
  const TopkDevice& dev = topk_device(device);
  a.cluster = topk_cluster(d.T, d.L, dev);
  a.span = ((d.L + a.cluster - 1) / a.cluster + 3) / 4 * 4;
  a.cache = dev.cache && a.span <= kTopkCacheRows;
  C10_CUDA_CHECK(launch_topk_slots(a, stream));
}

}  // namespace
}  // namespace hisparse

TORCH_LIBRARY_IMPL(hisparse, CUDA, m) {
  m.impl("hisparse_resolve_residency", &hisparse::resolve_residency_cuda);
  m.impl("hisparse_gather", &hisparse::gather_cuda);
  m.impl("hisparse_invalidate", &hisparse::invalidate_cuda);
  m.impl("hisparse_save_rows", &hisparse::save_rows_cuda);
  m.impl("hisparse_topk_slots", &hisparse::topk_slots_cuda);
}
