// Does the GPU's page size for the host pool bound large-pool gathers?
//
// Gathers random 656-B (and 1152-B) rows from a 32 GiB host pool into device memory with a
// warp-per-row kernel, the pool allocated four ways:
//   hostalloc  cudaHostAlloc (the driver maps it to the GPU in small pages)
//   register   mmap + MADV_HUGEPAGE + cudaHostRegister (host huge pages, registered)
//   vmm_numa   cuMemCreate on the host NUMA node at the driver's recommended granularity
//              (2 MiB or more), mapped for the GPU and the CPU (cuMemMap + cuMemSetAccess)
//   vmm_host   the same with CU_MEM_LOCATION_TYPE_HOST
// Each timed call gathers a fresh random plan (rows uniform over the pool), L2 flushed before.
// With "cpu" among the kinds: CPU threads gather the same plans from a cudaHostAlloc pool into
// a pinned staging buffer (the host-side alternative: CPU gather, then one bulk copy).
// Build: nvcc -O3 -arch=sm_90 -o host_pages main.cu -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <random>
#include <string>
#include <thread>
#include <vector>

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_ != cudaSuccess) {                                                   \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

static bool drv_ok(CUresult r, const char* what) {
  if (r == CUDA_SUCCESS) return true;
  const char* s = nullptr;
  cuGetErrorString(r, &s);
  std::printf("  %s failed: %s\n", what, s ? s : "?");
  return false;
}

__device__ __forceinline__ unsigned mix(unsigned x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// plan[i] = random row in [0, rows)
__global__ void make_plan(int* plan, int n, long long rows, unsigned seed) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    unsigned long long h = (static_cast<unsigned long long>(mix(i * 2654435761u ^ seed)) << 32) |
                           mix(i ^ (seed * 40503u + 17u));
    plan[i] = static_cast<int>(h % static_cast<unsigned long long>(rows));
  }
}

// One warp per row; `words` 16-byte words per row; each lane keeps its loads in flight.
__global__ void __launch_bounds__(256) gather(const uint4* __restrict__ pool, uint4* __restrict__ dst,
                                              const int* __restrict__ plan, int n, int words) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * 8;
  for (int w = blockIdx.x * 8 + (threadIdx.x >> 5); w < n; w += warps) {
    const uint4* src = pool + static_cast<long long>(plan[w]) * words;
    uint4* to = dst + static_cast<long long>(w) * words;
    uint4 v[3];
#pragma unroll
    for (int p = 0; p < 3; ++p)
      if (p * 32 + lane < words) v[p] = __ldcs(src + p * 32 + lane);
#pragma unroll
    for (int p = 0; p < 3; ++p)
      if (p * 32 + lane < words) to[p * 32 + lane] = v[p];
  }
}

__global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

struct Pool {
  std::string name;
  char* p = nullptr;
  size_t bytes = 0;
  // cleanup
  int kind = 0;
  CUmemGenericAllocationHandle h = 0;
  size_t mapped = 0;
};

static bool alloc_vmm(Pool& P, size_t bytes, CUmemLocationType type, int dev) {
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = type;
  int numa = 0;
  if (type == CU_MEM_LOCATION_TYPE_HOST_NUMA) {
    CUdevice d;
    cuDeviceGet(&d, dev);
    if (cuDeviceGetAttribute(&numa, CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID, d) != CUDA_SUCCESS || numa < 0)
      numa = 0;
    int sup = 0;
    cuDeviceGetAttribute(&sup, CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, d);
    std::printf("  host NUMA id %d, HOST_NUMA VMM supported %d\n", numa, sup);
  }
  prop.location.id = numa;
  size_t gmin = 0, grec = 0;
  if (!drv_ok(cuMemGetAllocationGranularity(&gmin, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "granularity"))
    return false;
  cuMemGetAllocationGranularity(&grec, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  std::printf("  granularity min %zu KiB, recommended %zu KiB\n", gmin >> 10, grec >> 10);
  const size_t g = std::max(gmin, grec);
  const size_t sz = (bytes + g - 1) / g * g;
  if (!drv_ok(cuMemCreate(&P.h, sz, &prop, 0), "cuMemCreate")) return false;
  CUdeviceptr va = 0;
  if (!drv_ok(cuMemAddressReserve(&va, sz, g, 0, 0), "cuMemAddressReserve")) return false;
  if (!drv_ok(cuMemMap(va, sz, 0, P.h, 0), "cuMemMap")) return false;
  CUmemAccessDesc acc[2] = {};
  acc[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc[0].location.id = dev;
  acc[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  acc[1].location.type = type == CU_MEM_LOCATION_TYPE_HOST ? CU_MEM_LOCATION_TYPE_HOST : CU_MEM_LOCATION_TYPE_HOST_NUMA;
  acc[1].location.id = numa;
  acc[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  if (!drv_ok(cuMemSetAccess(va, sz, acc, 2), "cuMemSetAccess(device+host)")) {
    if (!drv_ok(cuMemSetAccess(va, sz, acc, 1), "cuMemSetAccess(device)")) return false;
    std::printf("  (no CPU access)\n");
  }
  P.p = reinterpret_cast<char*>(va);
  P.bytes = bytes;
  P.mapped = sz;
  P.kind = 3;
  return true;
}

static void free_pool(Pool& P) {
  CK(cudaDeviceSynchronize());
  if (P.kind == 1) CK(cudaFreeHost(P.p));
  if (P.kind == 2) {
    CK(cudaHostUnregister(P.p));
    munmap(P.p, P.bytes);
  }
  if (P.kind == 3) {
    cuMemUnmap(reinterpret_cast<CUdeviceptr>(P.p), P.mapped);
    cuMemAddressFree(reinterpret_cast<CUdeviceptr>(P.p), P.mapped);
    cuMemRelease(P.h);
  }
  P.p = nullptr;
}

int main(int argc, char** argv) {
  const size_t gib = argc > 1 ? std::atoll(argv[1]) : 32;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 30;
  const std::string only = argc > 3 ? argv[3] : "";
  const size_t bytes = gib << 30;
  int dev = 0;
  CK(cudaSetDevice(dev));
  CK(cudaFree(0));
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int maxn = 104960;
  int* plan;
  uint4* dst;
  CK(cudaMalloc(&plan, maxn * sizeof(int)));
  CK(cudaMalloc(&dst, size_t(maxn) * 72 * 16));
  int* flush;
  const size_t flush_bytes = 256u << 20;
  CK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  if (only.find("cpu") != std::string::npos) {
    char* pool;
    CK(cudaHostAlloc(reinterpret_cast<void**>(&pool), bytes, cudaHostAllocDefault));
    std::vector<std::thread> th;
    const int hw = static_cast<int>(std::thread::hardware_concurrency());
    for (int t = 0; t < hw; ++t)  // fault the pool in, in parallel
      th.emplace_back([=] { std::memset(pool + bytes / hw * t, 1, bytes / hw); });
    for (auto& t : th) t.join();
    char* stage;
    CK(cudaHostAlloc(reinterpret_cast<void**>(&stage), size_t(maxn) * 1152, cudaHostAllocDefault));
    std::printf("cpu gather into pinned staging, %zu GiB pool, %d hardware threads:\n", gib, hw);
    for (int row_bytes : {656, 1152}) {
      const long long rows = static_cast<long long>(bytes / row_bytes);
      for (int n : {104960, 2048}) {
        for (int T : {1, 4, 8, 16}) {
          if (T > hw) continue;
          std::vector<double> us;
          std::mt19937_64 rng(n + T);
          std::vector<long long> plan_h(n);
          for (int r = 0; r < reps / 3 + 3; ++r) {
            for (auto& x : plan_h) x = static_cast<long long>(rng() % rows);
            th.clear();
            const auto t0 = std::chrono::steady_clock::now();
            for (int t = 0; t < T; ++t)
              th.emplace_back([&, t] {
                for (int i = t; i < n; i += T)
                  std::memcpy(stage + size_t(i) * row_bytes, pool + plan_h[i] * row_bytes, row_bytes);
              });
            for (auto& x : th) x.join();
            const auto t1 = std::chrono::steady_clock::now();
            if (r >= 3) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
          }
          std::sort(us.begin(), us.end());
          const double med = us[us.size() / 2];
          std::printf("  row %4d B, %6d rows, %2d threads: median %8.1f us  %5.1f GB/s (threads started inside)\n",
                      row_bytes, n, T, med, double(n) * row_bytes / med / 1e3);
        }
      }
    }
    CK(cudaFreeHost(stage));
    CK(cudaFreeHost(pool));
  }
  const char* kinds[] = {"hostalloc", "register", "vmm_numa", "vmm_host"};
  for (int k = 0; k < 4; ++k) {
    if (!only.empty() && only.find(kinds[k]) == std::string::npos) continue;
    Pool P;
    P.name = kinds[k];
    std::printf("%s, %zu GiB:\n", kinds[k], gib);
    bool ok = true;
    if (k == 0) {
      CK(cudaHostAlloc(reinterpret_cast<void**>(&P.p), bytes, cudaHostAllocDefault));
      P.bytes = bytes;
      P.kind = 1;
    } else if (k == 1) {
      void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) {
        std::printf("  mmap failed\n");
        continue;
      }
      madvise(m, bytes, MADV_HUGEPAGE);
      P.p = static_cast<char*>(m);
      P.bytes = bytes;
      std::memset(P.p, 1, bytes);
      CK(cudaHostRegister(P.p, bytes, cudaHostRegisterDefault));
      P.kind = 2;
    } else {
      ok = alloc_vmm(P, bytes, k == 2 ? CU_MEM_LOCATION_TYPE_HOST_NUMA : CU_MEM_LOCATION_TYPE_HOST, dev);
    }
    if (!ok) {
      std::printf("  skipped\n");
      continue;
    }
    if (k != 1) {
      // CPU touch: proves CPU access and faults the pages in
      cudaEventRecord(e0);
      std::memset(P.p, 1, bytes);
      std::printf("  CPU memset ok (%.2f GB)\n", bytes / 1e9);
    }
    cudaPointerAttributes at;
    cudaError_t ae = cudaPointerGetAttributes(&at, P.p);
    std::printf("  pointer attributes: %s type %d devicePointer %p hostPointer %p\n",
                cudaGetErrorString(ae), int(at.type), at.devicePointer, at.hostPointer);
    (void)cudaGetLastError();
    for (int row_bytes : {656, 1152}) {
      const int words = row_bytes / 16;
      const long long rows = static_cast<long long>(bytes / row_bytes);
      for (int n : {104960, 2048}) {
        std::vector<float> ms;
        for (int r = 0; r < reps + 3; ++r) {
          make_plan<<<(n + 255) / 256, 256>>>(plan, n, rows, 1234567u + r * 7919u + n);
          CK(cudaMemsetAsync(flush, r & 0xff, flush_bytes));
          spin<<<1, 1>>>(20000);
          CK(cudaEventRecord(e0));
          const int grid = std::min((n + 7) / 8, sms * 8);
          gather<<<grid, 256>>>(reinterpret_cast<const uint4*>(P.p), dst, plan, n, words);
          CK(cudaEventRecord(e1));
          CK(cudaEventSynchronize(e1));
          CK(cudaGetLastError());
          float t;
          CK(cudaEventElapsedTime(&t, e0, e1));
          if (r >= 3) ms.push_back(t);
        }
        std::sort(ms.begin(), ms.end());
        const float med = ms[ms.size() / 2];
        std::printf("  row %4d B, %6d rows: median %8.1f us (p10 %.1f, p90 %.1f)  %5.1f GB/s  %5.1f M rows/s\n",
                    row_bytes, n, med * 1e3, ms[ms.size() / 10] * 1e3, ms[ms.size() * 9 / 10] * 1e3,
                    double(n) * row_bytes / (med * 1e-3) / 1e9, n / (med * 1e-3) / 1e6);
      }
    }
    // check data made it (CPU wrote 1s)
    std::vector<unsigned char> chk(656);
    CK(cudaMemcpy(chk.data(), dst, 656, cudaMemcpyDeviceToHost));
    std::printf("  data check: %s\n", chk[0] == 1 && chk[655] == 1 ? "ok" : "BAD");
    free_pool(P);
  }
  return 0;
}
