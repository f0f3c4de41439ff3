// How long the GPU takes to start a grid shaped like resolve's: per-block start times
// (%globaltimer) of an empty kernel launched with resolve's geometry at batch 64 (1024 threads,
// ~170 KB of dynamic shared memory per block), after a 256 MiB memset and a ~100 us spin, as
// bench_ops times resolve (median of 50 launches).
//   nvcc -O3 -arch=sm_90 benchmarks/resolve_stages/dispatch.cu -o /tmp/dispatch && /tmp/dispatch
#include <algorithm>
#include <cstdio>
#include <vector>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); return 1; } } while (0)
__global__ void spin(long long n) { long long t = clock64(); while (clock64() - t < n) {} }
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__global__ void stamp(unsigned long long* t) {
  extern __shared__ int sm[];
  if (threadIdx.x == 0) { t[2 * blockIdx.x] = gtime(); sm[0] = 1; }
  __syncthreads();
  if (threadIdx.x == 0) t[2 * blockIdx.x + 1] = gtime() + sm[0] - 1;
}
static double med(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int main() {
  char* flush; CK(cudaMalloc(&flush, 256 << 20));
  unsigned long long* t; CK(cudaMalloc(&t, 2 * 1024 * 8));
  CK(cudaFuncSetAttribute((const void*)stamp, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  struct Shape { int blocks, threads; size_t smem; };
  for (Shape s : {Shape{64, 1024, 170 * 1024}}) {
    std::vector<double> skew, last, dur;
    for (int i = 0; i < 50; ++i) {
      CK(cudaMemsetAsync(flush, i & 255, 256 << 20));
      spin<<<1, 1>>>(200000);
      CK(cudaEventRecord(e0)); stamp<<<s.blocks, s.threads, s.smem>>>(t); CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1)); CK(cudaGetLastError());
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); dur.push_back(ms * 1000.0);
      std::vector<unsigned long long> h(2 * s.blocks);
      CK(cudaMemcpy(h.data(), t, h.size() * 8, cudaMemcpyDeviceToHost));
      unsigned long long lo = ~0ull, hi = 0, end = 0;
      for (int b = 0; b < s.blocks; ++b) { lo = std::min(lo, h[2 * b]); hi = std::max(hi, h[2 * b]); end = std::max(end, h[2 * b + 1]); }
      skew.push_back((hi - lo) / 1000.0); last.push_back((end - lo) / 1000.0);
    }
    printf("blocks %4d x %4d threads, %3zu KB smem: event %.2f us, block starts spread %.2f us, first start -> last end %.2f us\n",
           s.blocks, s.threads, s.smem / 1024, med(dur), med(skew), med(last));
  }
  return 0;
}
