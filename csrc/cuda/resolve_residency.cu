// resolve_residency's kernel: bit-identical to the C++ CPU reference (cpu_ops.cpp) and to
// docs/ops.md. Fixed launch geometry, no host reads of device data: graph-capturable.
#include <type_traits>

#include "common.cuh"
#include "kernels.cuh"

namespace hisparse {
namespace cuda {
namespace {

__device__ __forceinline__ unsigned hash_slot(int key, int shift) {
  return (static_cast<unsigned>(key) * 0x9E3779B1u) >> shift;
}

// Linear probing for N keys at once: v[u] is what the probe at h[u] saw. A chain ends at an
// empty entry (-1) or at its own key; the chains that go on advance together, one probe(h, u)
// each per round, so a thread waits for its longest chain rather than for the sum of its
// chains. Shared by the lookups (probe = a load) and the inserts (probe = atomicCAS). Every lane
// of the warp must call it: the warp reconverges at the end (the code after the chains otherwise
// ran once per group of lanes that left the loop together, measured 2.4 times per warp).
template <int N, class Probe>
__device__ __forceinline__ void follow_chains(unsigned (&h)[N], int (&v)[N], const int (&k)[N],
                                              unsigned mask, Probe probe) {
  unsigned more = 0;  // bit u: chain u goes on
#pragma unroll
  for (int u = 0; u < N; ++u) more |= (v[u] != -1 && v[u] != k[u]) ? 1u << u : 0u;
  while (more != 0) {
#pragma unroll
    for (int u = 0; u < N; ++u) {
      if ((more >> u) & 1u) {
        h[u] = (h[u] + 1) & mask;
        v[u] = probe(h[u], u);
      }
    }
    more = 0;
#pragma unroll
    for (int u = 0; u < N; ++u) more |= (v[u] != -1 && v[u] != k[u]) ? 1u << u : 0u;
  }
  __syncwarp();
}

// Hash indices of N keys (-1: absent, or a key < 0); the first probe of every key is issued
// at once. Every lane of the warp must call it (follow_chains).
template <int N>
__device__ __forceinline__ void find_keys(const int* hkey, const int (&k)[N], int (&found)[N],
                                          int shift, unsigned mask) {
  unsigned h[N];
  int hk[N];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    h[u] = hash_slot(k[u], shift);
    hk[u] = k[u] >= 0 ? hkey[h[u]] : -1;  // keys >= 0 only
  }
  follow_chains<N>(h, hk, k, mask, [&](unsigned hh, int) { return hkey[hh]; });
#pragma unroll
  for (int u = 0; u < N; ++u) found[u] = hk[u] != -1 ? static_cast<int>(h[u]) : -1;
}

// Slot `slot` holds the key at hash index h: its hit slot becomes the lowest such slot (the
// first-occurrence half is final by now). True when another slot had claimed it already.
__device__ __forceinline__ bool claim_hit_slot(unsigned* hfs, int h, int slot) {
  const unsigned old = atomicMin(&hfs[h], (hfs[h] & 0xFFFF0000u) | static_cast<unsigned>(slot));
  return (old & kNone16) != kNone16;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most the newest group of this thread's copies is still in flight.
__device__ __forceinline__ void cp_async_wait_but_newest() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// Copies `nbytes` (even) from global memory to 16-byte aligned scratch, block-wide. With
// `async` the scratch is shared memory and the copies are cp.async (the caller commits them as
// a group and waits for it, then a barrier); otherwise plain loads and stores (global workspace).
template <int NT>
__device__ __forceinline__ void stage_copy(uint8_t* dst, const void* src_, int64_t nbytes,
                                           bool async) {
  const uint8_t* src = static_cast<const uint8_t*>(src_);
  const int tid = threadIdx.x;
  const uintptr_t sa = reinterpret_cast<uintptr_t>(src);
  if (async && ((sa | static_cast<uintptr_t>(nbytes)) & 15u) == 0 && nbytes <= INT_MAX) {
    // The usual case (16-byte aligned rows), in 32-bit arithmetic and without the unrolled
    // remainder handling of the general loop: staging is issue-bound on such overhead.
    const int n = static_cast<int>(nbytes >> 4);
#pragma unroll 1
    for (int i = tid; i < n; i += NT) cp_async16(dst + 16 * i, src + 16 * i);
    return;
  }
  int64_t done = 0;
  if ((sa & 15u) == 0) {
    const int64_t n = nbytes >> 4;
    for (int64_t i = tid; i < n; i += NT) {
      if (async)
        cp_async16(dst + 16 * i, src + 16 * i);
      else
        reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
    done = n << 4;
  } else if ((sa & 3u) == 0) {
    const int64_t n = nbytes >> 2;
    for (int64_t i = tid; i < n; i += NT) {
      if (async)
        cp_async4(dst + 4 * i, src + 4 * i);
      else
        reinterpret_cast<uint32_t*>(dst)[i] = reinterpret_cast<const uint32_t*>(src)[i];
    }
    done = n << 2;
  }
  for (int64_t b = done + 2 * tid; b < nbytes; b += 2 * NT)
    *reinterpret_cast<int16_t*>(dst + b) = *reinterpret_cast<const int16_t*>(src + b);
}

// Scratch and per-row values shared by the stages of one row.
struct RowScratch {
  int* hkey;         // hash: key
  unsigned* hfs;     // hash: first occurrence << 16 | hit or assigned slot
  int* hidx;         // per entry: key as loaded, then its hash index (-1 padding, -2 resident)
  int* sslot;        // per slot: key as loaded, then (tiled path) its hash index (-1: none)
  int16_t* sorder;   // the LRU order as loaded
  int16_t* list;     // evictable slots (front; fused path: only those a miss takes) and,
                     // tiled path, hit slots (back), in LRU order (tiled path: a bitmap of
                     // the listed slots before that)
  int32_t* out;      // this row's outputs
  int32_t* msrc;
  int32_t* mdst;
  int32_t* sk;       // the state row's slot keys (global)
  int16_t* order;    // the state row's LRU order (global)
  int K, H, row_base;
  bool unique_holders;  // tiled path: no selected key is held by two slots of the state row
};

// Scan flags, two bits per item in one word (registers are the scarce resource here).
constexpr unsigned kFlagEvict = 1u, kFlagHit = 2u;
__device__ __forceinline__ unsigned flag_of(unsigned bits, int k) { return (bits >> (2 * k)) & 3u; }
// The packed scan counter an item adds: low 16 bits the first kind, high 16 bits the second.
__device__ __forceinline__ unsigned count_of(unsigned flag) {
  return flag == kFlagEvict ? 1u : flag == kFlagHit ? 0x10000u : 0u;
}

// The hit-slot test of one LRU entry: its flag (kFlagEvict, kFlagHit or 0 for an entry outside
// the order or a corrupted one).
__device__ __forceinline__ unsigned lru_flag(const RowScratch& w, int x) {
  if (x < 0 || x >= w.H) return 0u;
  const int h = w.sslot[x];
  const bool hit =
      h >= 0 && (w.unique_holders || (w.hfs[h] & kNone16) == static_cast<unsigned>(x));
  return hit ? kFlagHit : kFlagEvict;
}

// Tiled path: LRU positions p0..p0+IT-1 of the order (p0 < H), as loaded, and their flags:
// evictable, the hit slot of its key, or nothing (past the end or a corrupted entry).
template <int IT>
struct LruItems {
  typename std::conditional<IT == 8, uint4, uint2>::type raw;
  unsigned bits;
  __device__ __forceinline__ int slot(int k) const {
    return reinterpret_cast<const int16_t*>(&raw)[k];
  }
};

template <int IT>
__device__ __forceinline__ unsigned lru_flags(const RowScratch& w, int p0, LruItems<IT>& it) {
  static_assert(IT == 4 || IT == 8, "scan items per thread");
  it.raw = *reinterpret_cast<const decltype(it.raw)*>(w.sorder + p0);
  unsigned local = 0, bits = 0;
#pragma unroll
  for (int k = 0; k < IT; ++k) {
    const unsigned f = p0 + k < w.H ? lru_flag(w, it.slot(k)) : 0u;
    bits |= f << (2 * k);
    local += count_of(f);
  }
  it.bits = bits;
  return local;
}

// Evictable slots to list[run's low half ...], hit slots to list[H - 1 - run's high half ...].
template <int IT>
__device__ __forceinline__ void lru_scatter(const RowScratch& w, const LruItems<IT>& it,
                                            unsigned run) {
#pragma unroll
  for (int k = 0; k < IT; ++k) {
    const unsigned f = flag_of(it.bits, k);
    if (f == kFlagEvict)
      w.list[run & 0xFFFFu] = static_cast<int16_t>(it.slot(k));
    else if (f == kFlagHit)
      w.list[w.H - 1 - static_cast<int>(run >> 16)] = static_cast<int16_t>(it.slot(k));
    run += count_of(f);
  }
}

// Tiled path: key entries i0..i0+IT-1 (i0 < K): their hash indices and flags: first occurrence
// of a miss (kFlagEvict: it takes an evictable slot), first occurrence of a hit, or neither.
template <int IT>
struct KeyItems {
  int h[IT];
  unsigned bits;
};

template <int IT>
__device__ __forceinline__ unsigned miss_flags(const RowScratch& w, int i0, KeyItems<IT>& it) {
  if constexpr (IT % 4 == 0) {
#pragma unroll
    for (int q = 0; q < IT; q += 4) {
      const int4 v = *reinterpret_cast<const int4*>(w.hidx + i0 + q);
      it.h[q] = v.x;
      it.h[q + 1] = v.y;
      it.h[q + 2] = v.z;
      it.h[q + 3] = v.w;
    }
  } else {
    static_assert(IT == 2, "key items per thread");
    const int2 v = *reinterpret_cast<const int2*>(w.hidx + i0);
    it.h[0] = v.x;
    it.h[1] = v.y;
  }
  unsigned local = 0, bits = 0;
#pragma unroll
  for (int k = 0; k < IT; ++k) {
    if (i0 + k < w.K && it.h[k] >= 0) {
      const unsigned e = w.hfs[it.h[k]];
      if ((e >> 16) == static_cast<unsigned>(i0 + k)) {
        const unsigned f = (e & kNone16) == kNone16 ? kFlagEvict : kFlagHit;
        bits |= f << (2 * k);
        local += count_of(f);
      }
    }
  }
  it.bits = bits;
  return local;
}

// The m-th miss (first occurrence: entry i at hash index h) takes the m-th evictable slot
// (rule 4). Returns its output row, -1 when no evictable slot is left (corrupted LRU only).
__device__ __forceinline__ int assign_miss(const RowScratch& w, int h, int i, int m, int E) {
  if (m >= E) return -1;
  const int slot = w.list[m];
  const int key = w.hkey[h];
  // only the first occurrence's thread writes hfs[h]; others read only its (fixed) high half
  w.hfs[h] = (static_cast<unsigned>(i) << 16) | static_cast<unsigned>(slot);
  w.sk[slot] = key;
  w.msrc[m] = key;
  w.mdst[m] = w.row_base + slot;
  return w.row_base + slot;
}

// Rule 5: untaken evictable slots, the newly filled ones (miss order), then the hit slots.
template <int NT>
__device__ __forceinline__ void write_lru(const RowScratch& w, int E, int NH, int M) {
  const int keep = E - M;
  for (int p = threadIdx.x; p < E + NH; p += NT) {
    int16_t v;
    if (p < keep)
      v = w.list[M + p];
    else if (p < E)
      v = w.list[p - keep];
    else
      v = w.list[w.H - 1 - (p - E)];
    w.order[p] = v;
  }
}

// How a lookup by LRU position claims the hit slot of the key it finds (position_flags).
enum class Claim {
  kPlain,   // a 16-bit store of the slot: right when no key has two listed holders
  kAtomic,  // atomicMin: the lowest holder wins; *dup tells whether any key had two
  kCheck,   // no claim: a holder is the hit slot only if it won the atomic claims before
};

// The flags of LRU positions pw + k * 32 + lane (k < IT): evictable, the hit slot of a selected
// key, or nothing (past the end or a corrupted entry). The slot at each position is looked up in
// the hash directly. With kPlain and kAtomic every holder of a selected key claims it and counts
// as its hit slot, which is final when no key has two holders.
template <int IT>
__device__ __forceinline__ unsigned position_flags(const RowScratch& w, int pw, int lane,
                                                   int shift, unsigned mask, Claim claim,
                                                   bool* dup) {
  int x[IT], key[IT], found[IT];
  bool listed[IT];  // a slot id in range (x in [0, H) as one unsigned compare)
#pragma unroll
  for (int k = 0; k < IT; ++k) {
    const int p = pw + k * 32 + lane;
    x[k] = p < w.H ? w.sorder[p] : -1;
    listed[k] = static_cast<unsigned>(x[k]) < static_cast<unsigned>(w.H);
  }
#pragma unroll
  for (int k = 0; k < IT; ++k) key[k] = listed[k] ? w.sslot[x[k]] : -1;
  find_keys<IT>(w.hkey, key, found, shift, mask);
  unsigned bits = 0;
#pragma unroll
  for (int k = 0; k < IT; ++k) {
    bool hit = found[k] >= 0;  // only a listed slot has a key to find
    if (hit && claim == Claim::kPlain)  // the low half of the entry's second word
      reinterpret_cast<uint16_t*>(w.hfs)[2 * found[k]] = static_cast<uint16_t>(x[k]);
    else if (hit && claim == Claim::kAtomic)
      *dup |= claim_hit_slot(w.hfs, found[k], x[k]);
    else if (hit)
      hit = (w.hfs[found[k]] & kNone16) == static_cast<unsigned>(x[k]);
    bits |= (hit ? kFlagHit : listed[k] ? kFlagEvict : 0u) << (2 * k);
  }
  return bits;
}

// Ranks of the flagged items of a warp, IT rounds of 32 (lane l the l-th item of each round),
// from ballots. Packed: low 16 bits among the kFlagEvict items, high 16 bits among the
// kFlagHit ones; *run receives the warp's totals.
template <int IT>
__device__ __forceinline__ void warp_ranks(unsigned bits, unsigned (&rank)[IT], unsigned* run) {
  const unsigned below = (1u << (threadIdx.x & 31)) - 1u;
  unsigned r = 0;
#pragma unroll
  for (int k = 0; k < IT; ++k) {
    const unsigned f = flag_of(bits, k);
    const unsigned me = __ballot_sync(0xffffffffu, f == kFlagEvict);
    const unsigned mh = __ballot_sync(0xffffffffu, f == kFlagHit);
    rank[k] = r + __popc(me & below) + (static_cast<unsigned>(__popc(mh & below)) << 16);
    r += __popc(me) + (static_cast<unsigned>(__popc(mh)) << 16);
  }
  *run = r;
}

// Ranks of a fused row (packed: low 16 bits evictable slots / misses, high 16 bits hits):
// of its LRU positions (warp_ranks of their flags), of its key entries (first occurrences of
// misses and of hits, rank_keys), and the block-wide exclusive prefix and totals of both.
template <int IT, int KT>
struct FusedRanks {
  unsigned lrank[IT], lrun, krank[KT], kbits;
  int kh[KT];    // hash index of each key entry (-1 padding, -2 resident)
  bool pending;  // this thread has a later occurrence of a miss (slot known after assignment)
  bool any_pending;
  uint2 before, tot;  // (positions, keys) in the warps before this one, and in the row
};

// The key entries' part of FusedRanks and the block scan, once the claims are in (o.lrank and
// o.lrun are computed before the barrier, while other warps still claim).
template <int NT, int IT, int KT>
__device__ __forceinline__ void rank_keys(const RowScratch& w, uint2* warp_tot2,
                                          FusedRanks<IT, KT>& o) {
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, iw = warp * 32 * KT;
  unsigned krun;
  o.kbits = 0;
  o.pending = false;
#pragma unroll
  for (int k = 0; k < KT; ++k) {
    const int i = iw + k * 32 + lane;
    unsigned f = 0;
    o.kh[k] = i < w.K ? w.hidx[i] : -1;
    if (o.kh[k] >= 0) {
      const unsigned e = w.hfs[o.kh[k]];
      const unsigned sl16 = e & kNone16;
      if ((e >> 16) == static_cast<unsigned>(i)) f = sl16 == kNone16 ? kFlagEvict : kFlagHit;
      if (sl16 != kNone16)  // a hit, any occurrence: its slot is final
        w.out[i] = w.row_base + static_cast<int>(sl16);
      else if (f == 0u)
        o.pending = true;
    }
    o.kbits |= f << (2 * k);
  }
  warp_ranks<KT>(o.kbits, o.krank, &krun);
  // The warps before this one and the row, from the warp totals: every warp sums them itself
  // after the barrier that publishes them, lane l holding warp l's (four warp reductions in
  // place of a five-step shuffle scan of two values). The packed halves never carry: each
  // sums to at most H. The same barrier tells whether any later occurrence of a miss waits
  // for its slot.
  if (lane == 0) warp_tot2[warp] = make_uint2(o.lrun, krun);
  o.any_pending = __syncthreads_or(o.pending);
  const uint2 v = lane < NW ? warp_tot2[lane] : make_uint2(0u, 0u);
  o.before = make_uint2(__reduce_add_sync(0xffffffffu, lane < warp ? v.x : 0u),
                        __reduce_add_sync(0xffffffffu, lane < warp ? v.y : 0u));
  o.tot = make_uint2(__reduce_add_sync(0xffffffffu, v.x), __reduce_add_sync(0xffffffffu, v.y));
}

// Stages 2-5 when the LRU order fits one scan tile and the keys half of one. Warp v takes a
// contiguous range of LRU positions (and of key entries) in rounds of 32, lane l taking the l-th
// position of each round: the slot lookups of a run of consecutive slots in the LRU order then
// fall in distinct banks (with IT consecutive positions per thread they were IT-way bank
// conflicts). Hits are found by LRU position, so the lookup itself yields each position's flag
// (a slot the order does not list, on a corrupted state only, holds nothing). Ranks within the
// warp come from ballots; one block scan of the warp totals serves both the LRU split and the
// miss numbering. Hit entries get their output in the key pass, the first occurrence of each
// miss from the thread that assigns its slot. Returns (hits, misses).
template <int NT>
__device__ __forceinline__ uint2 finish_row_fused(const RowScratch& w, uint2* warp_tot2,
                                                  int shift, unsigned mask) {
  constexpr int IT = kResolveTile / NT;  // LRU positions per thread
  constexpr int KT = IT / 2;             // key entries per thread
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pw = warp * 32 * IT, iw = warp * 32 * KT;
  // The hit slots are claimed with plain stores first. Two holders of one key (a corrupted or
  // hand-made state: resolve itself never fills a slot with a key a listed slot holds) show
  // as more hit slots than hit keys in the scan totals; the claims are then reset and made
  // again with atomicMin, and the lookups that lost are no longer hits.
  FusedRanks<IT, KT> rk;
  unsigned lbits = position_flags<IT>(w, pw, lane, shift, mask, Claim::kPlain, nullptr);
  warp_ranks<IT>(lbits, rk.lrank, &rk.lrun);
  __syncthreads();  // the claims are in
  rank_keys<NT>(w, warp_tot2, rk);
  if ((rk.tot.x >> 16) != (rk.tot.y >> 16)) {
    __syncthreads();  // every warp has read the totals and the claims
    for (unsigned h = tid; h <= mask; h += NT) w.hfs[h] |= kNone16;
    __syncthreads();
    bool dup = false;
    lbits = position_flags<IT>(w, pw, lane, shift, mask, Claim::kAtomic, &dup);
    if (__syncthreads_or(dup))
      lbits = position_flags<IT>(w, pw, lane, shift, mask, Claim::kCheck, nullptr);
    warp_ranks<IT>(lbits, rk.lrank, &rk.lrun);
    rank_keys<NT>(w, warp_tot2, rk);
  }
  const unsigned(&lrank)[IT] = rk.lrank;
  const unsigned(&krank)[KT] = rk.krank;
  const int(&kh)[KT] = rk.kh;
  const unsigned kbits = rk.kbits;
  const bool pending = rk.pending, any_pending = rk.any_pending;
  const uint2 before = rk.before, tot = rk.tot;
  const int E = static_cast<int>(tot.x & 0xFFFFu);
  const int M = min(static_cast<int>(tot.y & 0xFFFFu), E);
  // Rule 5 straight from the ranks, without a pass over a list: an evictable slot of rank e
  // moves to e - M when no miss takes it and to E - M + e when the e-th miss does; a hit slot
  // of rank h moves to E + h. Only the taken slots go through shared memory, for the misses.
  const int keep = E - M;
#pragma unroll
  for (int k = 0; k < IT; ++k) {
    const unsigned f = flag_of(lbits, k);
    if (f == 0u) continue;
    const int16_t x = w.sorder[pw + k * 32 + lane];
    const unsigned r = before.x + lrank[k];
    int pos;
    if (f == kFlagEvict) {
      const int e = static_cast<int>(r & 0xFFFFu);
      if (e < M) w.list[e] = x;
      pos = e < M ? keep + e : e - M;
    } else {
      pos = E + static_cast<int>(r >> 16);
    }
    w.order[pos] = x;
  }
  __syncthreads();  // the taken slots are listed
#pragma unroll
  for (int k = 0; k < KT; ++k) {
    if (flag_of(kbits, k) != kFlagEvict) continue;
    const int i = iw + k * 32 + lane;
    const int m = static_cast<int>((before.y + krank[k]) & 0xFFFFu);
    w.out[i] = assign_miss(w, kh[k], i, m, E);
  }
  if (any_pending) {
    __syncthreads();  // every miss has its slot
#pragma unroll
    for (int k = 0; k < KT; ++k) {
      const int i = iw + k * 32 + lane;
      if (pending && kh[k] >= 0 && flag_of(kbits, k) == 0u) {
        const unsigned sl16 = w.hfs[kh[k]] & kNone16;
        w.out[i] = sl16 == kNone16 ? -1 : w.row_base + static_cast<int>(sl16);
      }
    }
  }
  return make_uint2(tot.y >> 16, static_cast<unsigned>(M));
}

// Stages 2-5 for any H and K: the hits by slot, then the LRU order and the keys in tiles of
// kResolveTile, each tile one block scan. Returns (hits, misses).
template <int NT>
__device__ __forceinline__ uint2 finish_row_tiled(RowScratch& w, unsigned* warp_tot, int shift,
                                                  unsigned mask) {
  constexpr int TILE = kResolveTile;
  constexpr int IT = TILE / NT;
  constexpr int U = 4;  // slot lookups in flight per thread
  const int tid = threadIdx.x;
  // 2. Hits: the lowest slot holding a selected key, among the slots the LRU order lists (every
  //    slot, unless the state is corrupted: the fused path finds hits by LRU position, and both
  //    paths agree). `list` holds a bitmap of the listed slots until stage 3 (cleared while the
  //    row was staged). Each slot remembers its key's hash index.
  unsigned* listed = reinterpret_cast<unsigned*>(w.list);
  for (int p = tid; p < w.H; p += NT) {
    const int x = w.sorder[p];
    if (x >= 0 && x < w.H) atomicOr(&listed[x >> 5], 1u << (x & 31));
  }
  __syncthreads();
  bool dup_holder = false;
  for (int b = 0; b < w.H; b += U * NT) {  // the same rounds for every lane (find_keys)
    const int j0 = b + tid;
    int k[U], found[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * NT;
      k[u] = j < w.H && ((listed[j >> 5] >> (j & 31)) & 1u) ? w.sslot[j] : -1;
    }
    find_keys<U>(w.hkey, k, found, shift, mask);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = j0 + u * NT;
      if (j >= w.H) continue;
      if (found[u] >= 0) dup_holder |= claim_hit_slot(w.hfs, found[u], j);
      w.sslot[j] = found[u];
    }
  }
  // Without a key held by two slots, every slot holding a selected key is its hit slot.
  w.unique_holders = !__syncthreads_or(dup_holder);
  // 3. Evictable slots to list[0..E), hit slots to list[H-1..H-NH]. Packed counters: low 16
  //    bits evictable, high 16 bits hits (E + NH <= H < 0xFFFF never carries).
  unsigned carry = 0;
  for (int t0 = 0; t0 < w.H; t0 += TILE) {
    const int p0 = t0 + tid * IT;
    LruItems<IT> li;
    const unsigned local = p0 < w.H ? lru_flags<IT>(w, p0, li) : 0u;
    unsigned tot;
    const unsigned run = carry + block_exclusive_scan<NT>(local, warp_tot, &tot);
    if (p0 < w.H) lru_scatter<IT>(w, li, run);
    carry += tot;
  }
  const int E = static_cast<int>(carry & 0xFFFFu);
  const int NH = static_cast<int>(carry >> 16);
  __syncthreads();
  // 4. Number the misses by first occurrence; the m-th takes list[m]. Packed counters: low 16
  //    bits misses, high 16 bits hits (distinct keys).
  carry = 0;
  for (int t0 = 0; t0 < w.K; t0 += TILE) {
    const int i0 = t0 + tid * IT;
    KeyItems<IT> ki;
    const unsigned local = i0 < w.K ? miss_flags<IT>(w, i0, ki) : 0u;
    unsigned tot;
    unsigned run = carry + block_exclusive_scan<NT>(local, warp_tot, &tot);
    if (i0 < w.K) {
#pragma unroll
      for (int k = 0; k < IT; ++k) {
        const unsigned f = flag_of(ki.bits, k);
        if (f == kFlagEvict)
          assign_miss(w, ki.h[k], i0 + k, static_cast<int>(run & 0xFFFFu), E);
        run += count_of(f);
      }
    }
    carry += tot;
  }
  const int M = min(static_cast<int>(carry & 0xFFFFu), E);
  __syncthreads();
  // 5. Outputs of hot entries (padding and resident entries were written in stage 1).
  for (int i = tid; i < w.K; i += NT) {
    const int h = w.hidx[i];
    if (h >= 0) {
      const unsigned sl16 = w.hfs[h] & kNone16;
      w.out[i] = sl16 == kNone16 ? -1 : w.row_base + static_cast<int>(sl16);
    }
  }
  write_lru<NT>(w, E, NH, M);
  return make_uint2(carry >> 16, static_cast<unsigned>(M));
}

// One CTA per batch row (a fixed grid walks the rows when the batch is larger than the grid).
// Per row: (0) every global read issued at once into scratch, (1) hash the selected keys while
// the state row's slot keys and LRU order are still arriving, (2) find the hit slot of each
// key (fused: by LRU position, in one pass with 3), (3) split the LRU order into evictable and
// hit slots, (4) number the misses and assign them evictable slots, (5) write outputs and the
// new order.
// FUSED: the LRU order fits one scan tile and the keys half of one (fused_scans()); a template
// parameter so each kernel keeps only one finishing path's registers. SMEM: the scratch is in
// shared memory (else in the global workspace); a template parameter so that the compiler
// knows every scratch pointer is a shared one and emits shared-memory loads, stores and
// atomics instead of generic ones (which take the slower, long-scoreboard path).
template <int NT, bool FUSED, bool SMEM>
__global__ void __launch_bounds__(NT, 1024 / NT) resolve_kernel(const ResolveArgs a) {
  // Key inserts in flight per thread: in a fused row exactly one round (K <= UK * NT), so no
  // thread carries dead probe slots.
  constexpr int UK = FUSED ? kResolveTile / NT / 2 : 4;
  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ unsigned warp_tot[32];
  __shared__ uint2 warp_tot2[32];
  const int tid = threadIdx.x;
  const int K = a.K, H = a.H;
  const int cap = 1 << a.cap_log2;
  const int shift = 32 - a.cap_log2;
  const unsigned mask = static_cast<unsigned>(cap - 1);
  const bool has_res = a.resident != nullptr;
  const ResolveLayout lay(K, H, cap, has_res);
  static_assert(SMEM || !FUSED, "the fused path runs on shared scratch only");
  uint8_t* base = SMEM ? smem : a.workspace + int64_t(blockIdx.x) * a.ws_stride;
  RowScratch w;
  w.hkey = reinterpret_cast<int*>(base);
  w.hfs = reinterpret_cast<unsigned*>(w.hkey + cap);
  w.hidx = reinterpret_cast<int*>(base + lay.entries);
  w.sslot = reinterpret_cast<int*>(base + lay.slots);
  w.sorder = reinterpret_cast<int16_t*>(base + lay.order);
  w.list = reinterpret_cast<int16_t*>(base + lay.list);
  w.K = K;
  w.H = H;
  int* hkey = w.hkey;
  unsigned* hfs = w.hfs;
  int* hidx = w.hidx;
  int* sslot = w.sslot;
  const int* sres = reinterpret_cast<const int*>(base + lay.resident);

  for (int r = blockIdx.x; r < a.B; r += gridDim.x) {
    // 0. Stage the row (cp.async straight into shared memory). The state row index is read
    //    first: the state row's slot keys and order (the second of two dependent reads) wait
    //    for it, and read after the keys' copies were issued it arrived ~600 cycles later.
    //    The keys go next: a fused row (one insert round) reads them straight into registers
    //    (no copies to issue, no shared-memory round trip); the tiled path copies them in
    //    their own group, which does not depend on the state row. The earlier rows' state rows
    //    (rule 0) are read with the state row index, and the hash is cleared while they are in
    //    flight. Only the hash's key words are cleared: an entry's other word is written by
    //    the thread inserting its key.
    const int s = a.state_rows[r];
    const int s_prev = tid < r ? a.state_rows[tid] : -1;
    const int32_t* keys = a.top_k + int64_t(r) * K;
    int kreg[UK];
    if (FUSED) {
#pragma unroll
      for (int u = 0; u < UK; ++u) kreg[u] = tid + u * NT < K ? __ldg(keys + tid + u * NT) : -1;
    } else {
      stage_copy<NT>(reinterpret_cast<uint8_t*>(hidx), keys, int64_t(K) * 4, SMEM);
    }
    if (has_res)
      stage_copy<NT>(base + lay.resident, a.resident + int64_t(r) * K, int64_t(K) * 4, SMEM);
    if (SMEM) cp_async_commit();
#pragma unroll 1
    for (int j = tid; j < cap / 4; j += NT)  // cap >= 4
      reinterpret_cast<int4*>(hkey)[j] = make_int4(-1, -1, -1, -1);
    if (!FUSED)  // the tiled path's bitmap of listed slots
      for (int j = tid; j < (H + 31) / 32; j += NT) reinterpret_cast<unsigned*>(w.list)[j] = 0u;
    const bool in_range = s >= 0 && s < a.S;
    w.out = a.out_rows + int64_t(r) * K;
    w.sk = a.slot_keys + int64_t(in_range ? s : 0) * H;
    w.order = a.lru + int64_t(in_range ? s : 0) * H;
    bool dup = false;
    if (in_range) {
      stage_copy<NT>(reinterpret_cast<uint8_t*>(sslot), w.sk, int64_t(H) * 4, SMEM);
      stage_copy<NT>(reinterpret_cast<uint8_t*>(w.sorder), w.order, int64_t(H) * 2, SMEM);
      dup = s_prev == s;
#pragma unroll 1
      for (int q = tid + NT; q < r; q += NT) dup |= a.state_rows[q] == s;
    }
    if (SMEM) cp_async_commit();
    if (SMEM) cp_async_wait_but_newest();  // the keys (tiled) and resident rows
    const bool live = in_range && !__syncthreads_or(dup);
    if (!live) {  // padding row: rule 0
      for (int i = tid; i < K; i += NT) w.out[i] = -1;
      if (tid == 0) a.miss_count[r] = 0;
      if (SMEM) cp_async_wait_all();
      __syncthreads();  // every copy has landed before the next row restages
      continue;
    }
    w.msrc = a.miss_src + int64_t(r) * K;
    w.mdst = a.miss_dst + int64_t(r) * K;
    w.row_base = a.hot_base + s * H;

    // 1. Hash the selected keys (rules 1-3). The thread that inserts a key writes its entry
    //    index as the first occurrence; a key that occurs again gets the lowest of its entry
    //    indices in a pass after the barrier (rare: top-k rows seldom repeat a key). Padding
    //    and resident entries get their final output now. UK entries per thread probe at once.
    bool repeated = false;
    for (int b = 0; b < K; b += UK * NT) {  // the same rounds for every lane (follow_chains)
      const int i0 = b + tid;
      int k[UK];
      unsigned h[UK];
      unsigned go = 0;  // bit u: entry u inserts its key (a mask: bool arrays cost byte shuffles)
#pragma unroll
      for (int u = 0; u < UK; ++u) {
        const int i = i0 + u * NT;
        k[u] = i >= K ? -1 : FUSED ? kreg[u] : hidx[i];  // fused: one round, i0 = tid
        h[u] = 0;
        if (i >= K) continue;
        if (k[u] < 0 || k[u] >= a.num_keys) {
          hidx[i] = -1;
          w.out[i] = -1;
        } else if (has_res && sres[i] >= 0) {
          hidx[i] = -2;
          w.out[i] = sres[i];
        } else {
          h[u] = hash_slot(k[u], shift);
          go |= 1u << u;
        }
      }
      int old[UK];
#pragma unroll
      for (int u = 0; u < UK; ++u) old[u] = (go >> u) & 1u ? atomicCAS(&hkey[h[u]], -1, k[u]) : -1;
      follow_chains<UK>(h, old, k, mask,
                        [&](unsigned hh, int u) { return atomicCAS(&hkey[hh], -1, k[u]); });
#pragma unroll
      for (int u = 0; u < UK; ++u) {
        if (!((go >> u) & 1u)) continue;
        const int i = i0 + u * NT;
        if (old[u] == -1)
          hfs[h[u]] = (static_cast<unsigned>(i) << 16) | kNone16;
        else
          repeated = true;
        hidx[i] = static_cast<int>(h[u]);
      }
    }
    if (SMEM) cp_async_wait_all();
    if (__syncthreads_or(repeated)) {
      for (int i = tid; i < K; i += NT) {
        const int h = hidx[i];
        if (h >= 0) atomicMin(&hfs[h], (static_cast<unsigned>(i) << 16) | kNone16);
      }
      __syncthreads();
    }

    // 2. Hits: each path finds them its own way (by LRU position when fused, else by slot).
    const uint2 counts = FUSED ? finish_row_fused<NT>(w, warp_tot2, shift, mask)
                               : finish_row_tiled<NT>(w, warp_tot, shift, mask);
    if (tid == 0) {
      a.miss_count[r] = static_cast<int>(counts.y);
      atomicAdd(&a.stats[0], static_cast<unsigned long long>(counts.x));
      atomicAdd(&a.stats[1], static_cast<unsigned long long>(counts.y));
    }
    if (r + static_cast<int>(gridDim.x) < a.B) __syncthreads();  // scratch is reused
  }
}

// The fused finishing path needs the LRU order in one scan tile and the keys in half of one.
bool fused_scans(int K, int H) { return H <= kResolveTile && 2 * K <= kResolveTile; }

template <int NT, bool FUSED, bool SMEM>
void launch_one(const ResolveArgs& a, int grid, size_t smem, cudaStream_t stream) {
  resolve_kernel<NT, FUSED, SMEM><<<grid, NT, SMEM ? smem : 0, stream>>>(a);
}

template <int NT>
void launch_nt(const ResolveArgs& a, int grid, size_t smem, cudaStream_t stream) {
  if (a.workspace != nullptr)
    launch_one<NT, false, false>(a, grid, smem, stream);
  else if (fused_scans(a.K, a.H))
    launch_one<NT, true, true>(a, grid, smem, stream);
  else
    launch_one<NT, false, true>(a, grid, smem, stream);
}

}  // namespace

cudaError_t launch_resolve(const ResolveArgs& a, bool wide, int grid, size_t smem,
                           cudaStream_t stream) {
  if (wide)
    launch_nt<kResolveThreadsWide>(a, grid, smem, stream);
  else
    launch_nt<kResolveThreads>(a, grid, smem, stream);
  return cudaGetLastError();
}

cudaError_t set_resolve_max_smem(int bytes) {
  const void* kernels[] = {
      reinterpret_cast<const void*>(resolve_kernel<kResolveThreads, false, true>),
      reinterpret_cast<const void*>(resolve_kernel<kResolveThreads, true, true>),
      reinterpret_cast<const void*>(resolve_kernel<kResolveThreadsWide, false, true>),
      reinterpret_cast<const void*>(resolve_kernel<kResolveThreadsWide, true, true>)};
  for (const void* k : kernels) {
    const cudaError_t e =
        cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace hisparse
