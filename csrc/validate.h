// Argument checks shared by the CPU and CUDA backends, so both reject exactly the same inputs
// with exactly the same messages before any work is done.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "hisparse_limits.h"

namespace hisparse {

inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kByte: return "torch.uint8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kUInt64: return "torch.uint64";
    case at::kFloat: return "torch.float32";
    default: return std::string("torch.") + c10::toString(t);
  }
}

inline void check_defined(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), op, ": argument '", name, "' must be a tensor, got None");
}

inline void check_dtype(const at::Tensor& t, at::ScalarType want, const char* op,
                        const char* name) {
  TORCH_CHECK(t.scalar_type() == want, op, ": argument '", name, "' must be ",
              dtype_name(want), ", got ", dtype_name(t.scalar_type()));
}

inline void check_dim(const at::Tensor& t, int64_t dim, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == dim, op, ": argument '", name, "' must be ", dim,
              "-D, got shape ", t.sizes());
}

inline void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), op, ": argument '", name, "' must be contiguous");
}

inline void check_device(const at::Tensor& t, const at::Device& dev, const char* op,
                         const char* name) {
  TORCH_CHECK(t.device() == dev, op, ": argument '", name, "' must be on ", dev, ", got ",
              t.device());
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef want, const char* op,
                        const char* name) {
  TORCH_CHECK(t.sizes() == want, op, ": argument '", name, "' must have shape ", want,
              ", got ", t.sizes());
}

// dtype, rank, contiguity and device in one call, in that order.
inline void check_tensor(const at::Tensor& t, at::ScalarType dtype, int64_t dim,
                         const at::Device& dev, const char* op, const char* name) {
  check_defined(t, op, name);
  check_dtype(t, dtype, op, name);
  check_dim(t, dim, op, name);
  check_contiguous(t, op, name);
  check_device(t, dev, op, name);
}

// Geometry of a host or hot view: rows addressed as block*block_size + j.
struct RowView {
  uint8_t* base = nullptr;
  int64_t num_blocks = 0;
  int64_t block_size = 1;
  int64_t block_stride = 0;  // bytes
  int64_t row_stride = 0;    // bytes
  int64_t row_bytes = 0;
  int64_t rows() const { return num_blocks * block_size; }
};

inline RowView check_row_view(const at::Tensor& t, const char* op, const std::string& name) {
  const char* n = name.c_str();
  check_defined(t, op, n);
  check_dtype(t, at::kByte, op, n);
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, op, ": argument '", n,
              "' must be 2-D [rows, row_bytes] or 3-D [blocks, block_size, row_bytes], got shape ",
              t.sizes());
  RowView v;
  v.row_bytes = t.size(-1);
  TORCH_CHECK(t.stride(-1) == 1 || v.row_bytes <= 1, op, ": argument '", n,
              "' must have last stride 1, got strides ", t.strides());
  TORCH_CHECK(v.row_bytes > 0 && v.row_bytes % kRowAlign == 0, op, ": argument '", n,
              "' row size must be a positive multiple of ", kRowAlign, " bytes, got ",
              v.row_bytes);
  if (t.dim() == 2) {
    v.num_blocks = t.size(0);
    v.block_size = 1;
    v.block_stride = t.stride(0);
    v.row_stride = t.stride(0);
  } else {
    v.num_blocks = t.size(0);
    v.block_size = t.size(1);
    v.block_stride = t.stride(0);
    v.row_stride = t.stride(1);
  }
  TORCH_CHECK(v.block_stride >= 0 && v.row_stride >= 0 && v.block_stride % kRowAlign == 0 &&
                  v.row_stride % kRowAlign == 0,
              op, ": argument '", n, "' strides must be non-negative multiples of ", kRowAlign,
              " bytes, got ", t.strides());
  v.base = static_cast<uint8_t*>(t.data_ptr());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(v.base) % kRowAlign == 0 || t.numel() == 0, op,
              ": argument '", n, "' data pointer must be ", kRowAlign, "-byte aligned");
  TORCH_CHECK(v.rows() <= kInt32Max, op, ": argument '", n, "' has more than 2^31-1 rows");
  return v;
}

// Problem sizes of resolve_residency, derived once validation passes.
struct ResolveDims {
  int64_t B, K, S, H;
  int64_t num_keys, hot_base;
};

// An integer argument taken as a Scalar (see register.cpp): a bool or a floating-point value is
// refused by name instead of being read as 0, 1 or a truncated number.
inline int64_t check_int_arg(const c10::Scalar& v, const char* op, const char* name) {
  TORCH_CHECK(v.isIntegral(/*includeBool=*/false), op, ": argument '", name,
              "' must be an int, got ", c10::toString(v.type()), " ", v);
  // A Python int in [2^63, 2^64) arrives as an unsigned Scalar, which toLong() would refuse
  // without naming the argument. Every int argument is a count or a row in [0, 2^31-1]; the
  // Python wrapper words the same refusal for integers torch cannot convert at all.
  TORCH_CHECK(v.type() != at::kUInt64 ||
                  v.toUInt64() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
              op, ": argument '", name, "' must be in [0, 2^31-1], got ", v.toUInt64());
  return v.toLong();
}

inline ResolveDims check_resolve_args(const at::Tensor& top_k, const at::Tensor& state_rows,
                                      const c10::optional<at::Tensor>& resident_rows,
                                      const at::Tensor& slot_keys, const at::Tensor& lru,
                                      const at::Tensor& stats, const at::Tensor& out_rows,
                                      const at::Tensor& miss_src, const at::Tensor& miss_dst,
                                      const at::Tensor& miss_count,
                                      const c10::Scalar& num_keys_arg,
                                      const c10::Scalar& hot_base_arg) {
  const char* op = "hisparse_resolve_residency";
  check_defined(top_k, op, "top_k");
  const at::Device dev = top_k.device();
  check_tensor(top_k, at::kInt, 2, dev, op, "top_k");
  const int64_t B = top_k.size(0), K = top_k.size(1);
  TORCH_CHECK(K >= 1, op, ": argument 'top_k' must have at least one column, got shape ",
              top_k.sizes());
  check_tensor(state_rows, at::kInt, 1, dev, op, "state_rows");
  check_shape(state_rows, {B}, op, "state_rows");
  if (resident_rows.has_value() && resident_rows->defined()) {
    check_tensor(*resident_rows, at::kInt, 2, dev, op, "resident_rows");
    check_shape(*resident_rows, {B, K}, op, "resident_rows");
  }
  check_tensor(slot_keys, at::kInt, 2, dev, op, "slot_keys");
  const int64_t S = slot_keys.size(0), H = slot_keys.size(1);
  TORCH_CHECK(H >= K && H <= kMaxHotSize, op, ": argument 'slot_keys' hot size H must satisfy ",
              "top-k K <= H <= ", kMaxHotSize, ", got K=", K, " H=", H);
  check_tensor(lru, at::kShort, 2, dev, op, "lru");
  check_shape(lru, {S, H}, op, "lru");
  check_tensor(stats, at::kUInt64, 1, dev, op, "stats");
  check_shape(stats, {2}, op, "stats");
  check_tensor(out_rows, at::kInt, 2, dev, op, "out_rows");
  check_shape(out_rows, {B, K}, op, "out_rows");
  check_tensor(miss_src, at::kInt, 2, dev, op, "miss_src");
  check_shape(miss_src, {B, K}, op, "miss_src");
  check_tensor(miss_dst, at::kInt, 2, dev, op, "miss_dst");
  check_shape(miss_dst, {B, K}, op, "miss_dst");
  check_tensor(miss_count, at::kInt, 1, dev, op, "miss_count");
  check_shape(miss_count, {B}, op, "miss_count");
  const int64_t num_keys = check_int_arg(num_keys_arg, op, "num_keys");
  const int64_t hot_base = check_int_arg(hot_base_arg, op, "hot_base");
  TORCH_CHECK(num_keys >= 0 && num_keys <= kInt32Max, op,
              ": argument 'num_keys' must be in [0, 2^31-1], got ", num_keys);
  TORCH_CHECK(hot_base >= 0 && hot_base <= kInt32Max - S * H, op,
              ": argument 'hot_base' must be >= 0 with hot_base + S*H <= 2^31-1, got hot_base=",
              hot_base, " S*H=", S * H);
  return {B, K, S, H, num_keys, hot_base};
}

struct GatherPlan {
  int64_t B, K;
  std::vector<RowView> host, hot;
};

// `host_ok` decides whether a host view may live where it is (backend-specific: the CUDA
// backend needs pinned host memory or the hot view's device).
template <typename HostOk>
GatherPlan check_gather_args(at::TensorList host, at::TensorList hot, const at::Tensor& miss_src,
                             const at::Tensor& miss_dst, const at::Tensor& miss_count,
                             const c10::optional<at::Tensor>& moved_bytes, HostOk host_ok) {
  const char* op = "hisparse_gather";
  TORCH_CHECK(host.size() >= 1, op, ": argument 'host' must list at least one view");
  TORCH_CHECK(host.size() == hot.size(), op, ": arguments 'host' and 'hot' must have the same ",
              "length, got ", host.size(), " and ", hot.size());
  check_defined(miss_src, op, "miss_src");
  const at::Device dev = miss_src.device();
  check_tensor(miss_src, at::kInt, 2, dev, op, "miss_src");
  const int64_t B = miss_src.size(0), K = miss_src.size(1);
  check_tensor(miss_dst, at::kInt, 2, dev, op, "miss_dst");
  check_shape(miss_dst, {B, K}, op, "miss_dst");
  check_tensor(miss_count, at::kInt, 1, dev, op, "miss_count");
  check_shape(miss_count, {B}, op, "miss_count");
  if (moved_bytes.has_value() && moved_bytes->defined()) {
    check_tensor(*moved_bytes, at::kUInt64, 1, dev, op, "moved_bytes");
    check_shape(*moved_bytes, {1}, op, "moved_bytes");
  }
  GatherPlan plan{B, K, {}, {}};
  for (size_t l = 0; l < host.size(); ++l) {
    const std::string hn = "host[" + std::to_string(l) + "]";
    const std::string dn = "hot[" + std::to_string(l) + "]";
    RowView h = check_row_view(host[l], op, hn);
    RowView d = check_row_view(hot[l], op, dn);
    check_device(hot[l], dev, op, dn.c_str());
    host_ok(host[l], hn);
    TORCH_CHECK(h.row_bytes == d.row_bytes, op, ": arguments '", hn, "' and '", dn,
                "' must have the same row size, got ", h.row_bytes, " and ", d.row_bytes);
    plan.host.push_back(h);
    plan.hot.push_back(d);
  }
  return plan;
}

struct SavePlan {
  int64_t N;
  std::vector<RowView> src, host;
};

// save_rows: `src[l]` holds the new rows of member layer l, `host[l]` is its host view;
// `host_ok` decides where a host view may live (backend-specific, as for gather).
template <typename HostOk>
SavePlan check_save_args(at::TensorList src, at::TensorList host, const at::Tensor& src_rows,
                         const at::Tensor& host_rows, const c10::optional<at::Tensor>& moved_bytes,
                         HostOk host_ok) {
  const char* op = "hisparse_save_rows";
  TORCH_CHECK(src.size() >= 1, op, ": argument 'src' must list at least one view");
  TORCH_CHECK(src.size() == host.size(), op, ": arguments 'src' and 'host' must have the same ",
              "length, got ", src.size(), " and ", host.size());
  check_defined(src_rows, op, "src_rows");
  const at::Device dev = src_rows.device();
  check_tensor(src_rows, at::kInt, 1, dev, op, "src_rows");
  const int64_t N = src_rows.size(0);
  TORCH_CHECK(N <= kInt32Max, op, ": argument 'src_rows' has more than 2^31-1 entries");
  check_tensor(host_rows, at::kInt, 1, dev, op, "host_rows");
  check_shape(host_rows, {N}, op, "host_rows");
  if (moved_bytes.has_value() && moved_bytes->defined()) {
    check_tensor(*moved_bytes, at::kUInt64, 1, dev, op, "moved_bytes");
    check_shape(*moved_bytes, {1}, op, "moved_bytes");
  }
  SavePlan plan{N, {}, {}};
  for (size_t l = 0; l < src.size(); ++l) {
    const std::string sn = "src[" + std::to_string(l) + "]";
    const std::string hn = "host[" + std::to_string(l) + "]";
    RowView s = check_row_view(src[l], op, sn);
    RowView h = check_row_view(host[l], op, hn);
    check_device(src[l], dev, op, sn.c_str());
    host_ok(host[l], hn);
    TORCH_CHECK(s.row_bytes == h.row_bytes, op, ": arguments '", sn, "' and '", hn,
                "' must have the same row size, got ", s.row_bytes, " and ", h.row_bytes);
    plan.src.push_back(s);
    plan.host.push_back(h);
  }
  return plan;
}

struct InvalidateDims {
  int64_t N, S, H;
};

inline InvalidateDims check_invalidate_args(const at::Tensor& slot_keys, const at::Tensor& lru,
                                            const at::Tensor& state_rows,
                                            const c10::optional<at::Tensor>& keys) {
  const char* op = "hisparse_invalidate";
  check_defined(slot_keys, op, "slot_keys");
  const at::Device dev = slot_keys.device();
  check_tensor(slot_keys, at::kInt, 2, dev, op, "slot_keys");
  const int64_t S = slot_keys.size(0), H = slot_keys.size(1);
  TORCH_CHECK(H >= 1 && H <= kMaxHotSize, op, ": argument 'slot_keys' hot size H must be in [1, ",
              kMaxHotSize, "], got ", H);
  check_tensor(lru, at::kShort, 2, dev, op, "lru");
  check_shape(lru, {S, H}, op, "lru");
  check_tensor(state_rows, at::kInt, 1, dev, op, "state_rows");
  const int64_t N = state_rows.size(0);
  if (keys.has_value() && keys->defined()) {
    check_tensor(*keys, at::kInt, 1, dev, op, "keys");
    check_shape(*keys, {N}, op, "keys");
  }
  return {N, S, H};
}

// Problem sizes of topk_slots, derived once validation passes.
struct TopkSlotsDims {
  int64_t T, L, ld, K, R, W, block_size;  // ld: the scores' row stride
};

inline void check_index_tensor(const at::Tensor& t, int64_t dim, const at::Device& dev,
                               const char* op, const char* name) {
  check_defined(t, op, name);
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": argument '",
              name, "' must be torch.int32 or torch.int64, got ", dtype_name(t.scalar_type()));
  check_dim(t, dim, op, name);
  check_contiguous(t, op, name);
  check_device(t, dev, op, name);
}

inline TopkSlotsDims check_topk_slots_args(const at::Tensor& scores, const at::Tensor& req,
                                           const at::Tensor& block_table,
                                           const c10::Scalar& block_size, const at::Tensor& out) {
  const char* op = "hisparse_topk_slots";
  check_defined(scores, op, "scores");
  const at::Device dev = scores.device();
  check_dtype(scores, at::kFloat, op, "scores");
  check_dim(scores, 2, op, "scores");
  const int64_t T = scores.size(0), L = scores.size(1);
  // Rows may sit in a wider buffer (a row stride past L), each row's scores side by side.
  TORCH_CHECK((scores.stride(1) == 1 || L <= 1) && (scores.stride(0) >= L || T <= 1), op,
              ": argument 'scores' must have contiguous rows, got strides ", scores.strides());
  check_index_tensor(req, 1, dev, op, "req");
  check_shape(req, {T}, op, "req");
  check_index_tensor(block_table, 2, dev, op, "block_table");
  const int64_t bs = check_int_arg(block_size, op, "block_size");
  TORCH_CHECK(bs >= 1 && bs <= kInt32Max, op, ": argument 'block_size' must be in [1, 2^31-1], ",
              "got ", bs);
  const int64_t R = block_table.size(0), W = block_table.size(1);
  TORCH_CHECK(L <= W * bs, op, ": argument 'scores' has ", L, " positions, more than ",
              "block_table covers (", W, " blocks of ", bs, ")");
  check_tensor(out, at::kLong, 2, dev, op, "out");
  TORCH_CHECK(out.size(0) == T, op, ": argument 'out' must have ", T, " rows like 'scores', got ",
              "shape ", out.sizes());
  const int64_t K = out.size(1);
  TORCH_CHECK(L <= kInt32Max && K <= kInt32Max, op, ": 'scores' and 'out' rows must hold at ",
              "most 2^31-1 entries");
  return {T, L, T <= 1 ? L : scores.stride(0), K, R, W, bs};
}

}  // namespace hisparse
