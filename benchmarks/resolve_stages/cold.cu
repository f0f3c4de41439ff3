// What a cold call of the resolve kernel waits for: the same call (new kernel, 1024 threads,
// hash 2^14, top-k 2048, hot 4096) timed after different preparations. Built by make.py's
// outputs (build/knew_stamp.cu):
//   nvcc -O3 -std=c++17 -arch=sm_90 -Icsrc -Ibenchmarks/resolve_stages/build \
//        benchmarks/resolve_stages/cold.cu -o /tmp/cold && /tmp/cold 100
// Modes: flush = 256 MiB memset (evicts L2: data and code); code = the same kernel run on other
// buffers (code in L2 and in the instruction caches of the SMs it ran on); data = a read of this
// call's buffers (data in L2). Each call is preceded by a ~100 us spin so launch is hidden.
#include "knew_stamp.cu"
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)
__global__ void spin(long long n) { long long t = clock64(); while (clock64() - t < n) {} }
__global__ void trivial(int* p) { if (threadIdx.x == 0 && p[0] == 12345) p[1] = 1; }
__global__ void touch(const int4* p, int64_t n, int* sink) {
  int4 acc = make_int4(0, 0, 0, 0);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int4 v = p[i]; acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w; }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x7fffffff) *sink = 1;
}
using hisparse::cuda::ResolveArgs; using hisparse::cuda::ResolveLayout;
static float med(std::vector<float> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
int main(int argc, char** argv) {
  const int K = 2048, H = 4096, CAP = 14;
  const int reps = argc > 1 ? atoi(argv[1]) : 100;
  auto fn = hisparse::cuda::resolve_kernel<1024, true, true, true>;
  const size_t smem = ResolveLayout(K, H, 1 << CAP, false).total;
  CK(cudaFuncSetAttribute((const void*)fn, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  char* flush; CK(cudaMalloc(&flush, 256 << 20));
  int* sink; CK(cudaMalloc(&sink, 64)); CK(cudaMemset(sink, 0, 64));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> U(0, 1);
  const int BMAX = 132;
  struct Set { int *tk, *sr, *out, *ms, *md, *mc, *sk; int16_t* lru; unsigned long long* st; };
  auto mk = [&](int B) { Set s; CK(cudaMalloc(&s.tk, B * K * 4)); CK(cudaMalloc(&s.sr, B * 4));
    CK(cudaMalloc(&s.out, B * K * 4)); CK(cudaMalloc(&s.ms, B * K * 4)); CK(cudaMalloc(&s.md, B * K * 4));
    CK(cudaMalloc(&s.mc, B * 4)); CK(cudaMalloc(&s.sk, B * H * 4)); CK(cudaMalloc(&s.lru, B * H * 2));
    CK(cudaMalloc(&s.st, 16)); CK(cudaMemset(s.st, 0, 16));
    std::vector<int> hsr(B); for (int i = 0; i < B; ++i) hsr[i] = i;
    CK(cudaMemcpy(s.sr, hsr.data(), B * 4, cudaMemcpyHostToDevice));
    std::vector<int> hsk(B * H, -1); std::vector<int16_t> hl(B * H);
    for (int r = 0; r < B; ++r) for (int j = 0; j < H; ++j) hl[r * H + j] = j;
    CK(cudaMemcpy(s.sk, hsk.data(), B * H * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(s.lru, hl.data(), B * H * 2, cudaMemcpyHostToDevice));
    std::vector<int> tk(B * K); for (auto& k : tk) k = rng() % (1 << 30);
    CK(cudaMemcpy(s.tk, tk.data(), B * K * 4, cudaMemcpyHostToDevice));
    return s; };
  auto args = [&](const Set& s, int B) { ResolveArgs a{}; a.top_k = s.tk; a.state_rows = s.sr; a.resident = nullptr;
    a.slot_keys = s.sk; a.lru = s.lru; a.stats = s.st; a.out_rows = s.out; a.miss_src = s.ms; a.miss_dst = s.md;
    a.miss_count = s.mc; a.workspace = nullptr; a.B = B; a.K = K; a.S = B; a.H = H; a.num_keys = 1 << 30;
    a.hot_base = 0; a.cap_log2 = CAP; return a; };
  Set dummy = mk(BMAX);
  const char* modes[] = {"flush", "flush+code(1 SM)", "flush+code(all SMs)", "flush+data", "flush+code+data", "nothing"};
  for (int B : {1, 64}) for (double rate : {0.001, 1.0}) {
    if (B == 64 && rate == 1.0) continue;
    Set s = mk(B);
    std::vector<int> cur(B * K); for (auto& k : cur) k = rng() % (1 << 30);
    std::vector<int> hsk(B * H, -1); std::vector<int16_t> hl(B * H);
    for (int r = 0; r < B; ++r) for (int j = 0; j < H; ++j) hl[r * H + j] = j;
    auto reset = [&] { CK(cudaMemcpy(s.sk, hsk.data(), B * H * 4, cudaMemcpyHostToDevice));
                       CK(cudaMemcpy(s.lru, hl.data(), B * H * 2, cudaMemcpyHostToDevice)); };
    printf("B=%d rate=%.3f   (us median; stage cycles median)\n", B, rate);
    for (int mode = 0; mode < 6; ++mode) {
      reset();
      for (int w = 0; w < 3; ++w) { for (auto& k : cur) if (U(rng) < (rate == 1.0 ? 0.3 : rate * 5)) k = rng() % (1 << 30);
        CK(cudaMemcpy(s.tk, cur.data(), B * K * 4, cudaMemcpyHostToDevice)); fn<<<B, 1024, smem>>>(args(s, B)); }
      std::vector<float> t; std::vector<long long> stg[5];
      for (int i = 0; i < reps; ++i) {
        for (auto& k : cur) if (U(rng) < rate) k = rng() % (1 << 30);
        CK(cudaMemcpy(s.tk, cur.data(), B * K * 4, cudaMemcpyHostToDevice));
        if (rate == 1.0) reset();
        if (mode != 5) CK(cudaMemsetAsync(flush, i & 255, 256 << 20));
        if (mode == 1) fn<<<1, 1024, smem>>>(args(dummy, 1));
        if (mode == 2 || mode == 4) fn<<<BMAX, 1024, smem>>>(args(dummy, BMAX));
        if (mode == 3 || mode == 4) {
          touch<<<132, 512>>>((const int4*)s.tk, (int64_t)B * K / 4, sink);
          touch<<<132, 512>>>((const int4*)s.sr, 1, sink);
          touch<<<132, 512>>>((const int4*)s.sk, (int64_t)B * H / 4, sink);
          touch<<<132, 512>>>((const int4*)s.lru, (int64_t)B * H / 8, sink);
        }
        spin<<<1, 1>>>(200000);
        CK(cudaEventRecord(e0)); fn<<<B, 1024, smem>>>(args(s, B)); CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1)); CK(cudaGetLastError());
        float ms_; CK(cudaEventElapsedTime(&ms_, e0, e1)); t.push_back(ms_ * 1000.f);
        long long hs[16]; CK(cudaMemcpyFromSymbol(hs, g_stamp2, sizeof(hs)));
        for (int k = 1; k <= 4; ++k) stg[k].push_back(hs[k] - hs[k - 1]);
      }
      auto m = [&](int k) { auto v = stg[k]; std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
      printf("  %-20s %6.2f us | stage0 %5lld hash %5lld hits %5lld rest %5lld\n", modes[mode], med(t), m(1), m(2), m(3), m(4));
    }
  }
  for (int mode : {0, 5}) {
    std::vector<float> t;
    for (int i = 0; i < reps; ++i) {
      if (mode == 0) CK(cudaMemsetAsync(flush, i & 255, 256 << 20));
      spin<<<1, 1>>>(200000);
      CK(cudaEventRecord(e0)); trivial<<<64, 1024>>>(sink); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      float ms_; CK(cudaEventElapsedTime(&ms_, e0, e1)); t.push_back(ms_ * 1000.f);
    }
    printf("trivial kernel, %s: %.2f us\n", mode == 0 ? "flush" : "nothing", med(t));
  }
  return 0;
}
