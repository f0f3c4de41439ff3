// Backend entry points of the hisparse ops. Schemas live in register.cpp; the semantics are in
// docs/ops.md. Each backend validates through validate.h before doing any work.
#pragma once

#include <ATen/ATen.h>

namespace hisparse {

void resolve_residency_cpu(const at::Tensor& top_k, const at::Tensor& state_rows,
                           const c10::optional<at::Tensor>& resident_rows, at::Tensor& slot_keys,
                           at::Tensor& lru, at::Tensor& stats, at::Tensor& out_rows,
                           at::Tensor& miss_src, at::Tensor& miss_dst, at::Tensor& miss_count,
                           const c10::Scalar& num_keys, const c10::Scalar& hot_base);

void gather_cpu(at::TensorList host, at::TensorList hot, const at::Tensor& miss_src,
                const at::Tensor& miss_dst, const at::Tensor& miss_count,
                const c10::optional<at::Tensor>& moved_bytes);

void save_rows_cpu(at::TensorList src, at::TensorList host, const at::Tensor& src_rows,
                   const at::Tensor& host_rows, const c10::optional<at::Tensor>& moved_bytes);

void invalidate_cpu(at::Tensor& slot_keys, at::Tensor& lru, const at::Tensor& state_rows,
                    const c10::optional<at::Tensor>& keys);

void topk_slots_cpu(const at::Tensor& scores, const at::Tensor& req,
                    const at::Tensor& block_table, const c10::Scalar& block_size, at::Tensor& out);

}  // namespace hisparse
