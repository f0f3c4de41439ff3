"""An experiment: the misses' rows copied host -> hot by Hopper's bulk-copy unit (TMA,
``cp.async.bulk``) from a few CTAs, instead of by SM loads from most of the GPU's SMs.

Why: an H200 run of bench_pcie_overlap.py showed a copy-engine transfer of the misses' bytes
hiding under the HBM-bound row read (overlap 0.93 at batch 64) while the same bytes fetched by
SM loads did not (0.11): SM loads from the pinned pool need most SMs to reach PCIe speed, and
there they slow the read. A bulk copy keeps its requests in flight without registers, so a few
CTAs might reach PCIe speed and leave the other SMs to the read; the copy engine itself cannot
take a plan the GPU computes inside a captured graph.

Each CTA takes the requests b = cta, cta + ctas, ...; one thread loads up to ``slots`` rows
(656 B each) host -> shared memory under one mbarrier, then stores them shared -> hot rows, and
waits for the stores to have read shared memory before the next batch. Built on first use with
torch's inline extension loader (sm_90a only).
"""

from __future__ import annotations

from cuda_timing import sm90a_module

CUDA_SRC = r"""
#include <cstdint>
#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

namespace {

__device__ __forceinline__ uint32_t smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__global__ void tma_gather_kernel(const uint8_t* __restrict__ host, uint8_t* __restrict__ hot,
                                  const int32_t* __restrict__ src, const int32_t* __restrict__ dst,
                                  const int32_t* __restrict__ count, int batch, int width,
                                  int row_bytes, int slots) {
  extern __shared__ __align__(128) uint8_t buf[];
  __shared__ __align__(8) uint64_t bar;
  if (threadIdx.x != 0) return;
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem(&bar)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  uint32_t phase = 0;
  int n = 0;
  int dst_rows[512];
  auto flush = [&]() {
    asm volatile(
        "{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
        " @!p bra W_%=;\n}" ::"r"(smem(&bar)), "r"(phase) : "memory");
    phase ^= 1;
    for (int s = 0; s < n; ++s) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   ::"l"(hot + (int64_t)dst_rows[s] * row_bytes), "r"(smem(buf + s * row_bytes)),
                   "r"(row_bytes) : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    n = 0;
  };
  for (int b = blockIdx.x; b < batch; b += gridDim.x) {
    const int c = count[b];
    for (int i = 0; i < c; ++i) {
      if (n == 0) {
        const int left = c - i;  // this request's rows; later requests start their own batch
        const int take = left < slots ? left : slots;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     ::"r"(smem(&bar)), "r"(take * row_bytes) : "memory");
      }
      const int64_t at = (int64_t)b * width + i;
      dst_rows[n] = dst[at];
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
          ::"r"(smem(buf + n * row_bytes)), "l"(host + (int64_t)src[at] * row_bytes),
          "r"(row_bytes), "r"(smem(&bar)) : "memory");
      ++n;
      if (n == slots || i == c - 1) flush();
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

}  // namespace

void tma_gather(torch::Tensor host, torch::Tensor hot, torch::Tensor src, torch::Tensor dst,
                torch::Tensor count, int64_t ctas, int64_t slots) {
  TORCH_CHECK(host.is_pinned() && hot.is_cuda(), "host must be pinned, hot on the GPU");
  TORCH_CHECK(slots >= 1 && slots <= 512, "slots must lie in [1, 512]");
  const int row = static_cast<int>(hot.size(1));
  TORCH_CHECK(row % 16 == 0, "bulk copies move multiples of 16 bytes");
  const int shared = static_cast<int>(slots) * row;
  auto k = tma_gather_kernel;
  C10_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, shared));
  k<<<static_cast<int>(ctas), 32, shared, c10::cuda::getCurrentCUDAStream()>>>(
      host.data_ptr<uint8_t>(), hot.data_ptr<uint8_t>(), src.data_ptr<int32_t>(),
      dst.data_ptr<int32_t>(), count.data_ptr<int32_t>(), static_cast<int>(dst.size(0)),
      static_cast<int>(dst.size(1)), row, static_cast<int>(slots));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""

DECLARATION = (
    "void tma_gather(torch::Tensor, torch::Tensor, torch::Tensor, "
    "torch::Tensor, torch::Tensor, int64_t, int64_t);"
)


def tma_gather(host, hot, miss_src, miss_dst, miss_count, *, ctas: int = 8, slots: int = 256):
    """``hot[miss_dst[b, i]] = host[miss_src[b, i]]`` for ``i < miss_count[b]`` by bulk copies
    from ``ctas`` CTAs, ``slots`` rows in flight per CTA (its shared memory)."""
    module = sm90a_module("hisparse_tma_gather", DECLARATION, CUDA_SRC)
    module.tma_gather(host, hot, miss_src, miss_dst, miss_count, ctas, slots)
