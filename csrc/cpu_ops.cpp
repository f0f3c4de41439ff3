// C++ CPU backend: the reference the CUDA backend must equal bit for bit (docs/ops.md).
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <unordered_set>
#include <vector>
#include <cstring>

#include "ops.h"
#include "validate.h"

namespace hisparse {

namespace {

// Which batch rows are live: state row in range and not claimed by an earlier batch row.
std::vector<char> live_rows(const int32_t* state_rows, int64_t B, int64_t S) {
  std::vector<char> live(B, 0);
  std::unordered_set<int32_t> seen;
  for (int64_t r = 0; r < B; ++r) {
    const int32_t s = state_rows[r];
    if (s >= 0 && s < S && seen.insert(s).second) live[r] = 1;
  }
  return live;
}

struct RowCounts {
  uint64_t hits = 0, misses = 0;
};

// Open-addressing map from a selected key to its index in first-occurrence order. Keys are
// >= 0, so -1 marks an empty bucket; the table is at least four times the row's entries (short
// probe runs), and a bucket holds key and index together (one cache line per probe).
class KeyIndex {
 public:
  void reset(int64_t entries) {
    int log2 = 4;
    while ((int64_t(1) << log2) < 4 * entries) ++log2;
    const size_t cap = size_t(1) << log2;
    if (table_.size() != cap) table_.resize(cap);
    std::fill(table_.begin(), table_.end(), Bucket{-1, 0});
    mask_ = cap - 1;
    shift_ = 32 - log2;
  }
  // Index of `key`, inserting `next` if it is new; `inserted` says which happened.
  int32_t find_or_insert(int32_t key, int32_t next, bool* inserted) {
    for (size_t h = bucket(key);; h = (h + 1) & mask_) {
      Bucket& b = table_[h];
      if (b.key == key) {
        *inserted = false;
        return b.val;
      }
      if (b.key == -1) {
        b = Bucket{key, next};
        *inserted = true;
        return next;
      }
    }
  }
  int32_t find(int32_t key) const {
    if (key < 0) return -1;
    for (size_t h = bucket(key);; h = (h + 1) & mask_) {
      const Bucket& b = table_[h];
      if (b.key == key) return b.val;
      if (b.key == -1) return -1;
    }
  }

 private:
  struct Bucket {
    int32_t key, val;
  };
  size_t bucket(int32_t key) const { return (static_cast<uint32_t>(key) * 0x9E3779B1u) >> shift_; }
  std::vector<Bucket> table_;
  size_t mask_ = 0;
  int shift_ = 28;
};

// Buffers reused across the rows of one thread's share of a call. Passed by reference rather
// than kept in a thread_local: in a shared library a thread_local goes through the dynamic TLS
// model, and the row loop ran 1.85x slower that way (measured on one core).
struct RowScratch {
  KeyIndex index;
  std::vector<int32_t> unique, entry_u, slot_of, miss_u, pos_u;
  std::vector<int16_t> evictable, hits_in_order;
};

RowCounts resolve_row(RowScratch& w, const int32_t* keys, const int32_t* resident,
                      int32_t* slot_keys, int16_t* lru, int32_t* out, int32_t* miss_src,
                      int32_t* miss_dst, int64_t K, int64_t H, int64_t num_keys,
                      int64_t row_base) {
  // Distinct selected keys in order of first occurrence; entry -> index into `unique`.
  KeyIndex& index = w.index;
  index.reset(K);
  std::vector<int32_t>& unique = w.unique;
  unique.clear();
  std::vector<int32_t>& entry_u = w.entry_u;
  entry_u.assign(K, -1);
  for (int64_t i = 0; i < K; ++i) {
    const int32_t k = keys[i];
    if (k < 0 || k >= num_keys) {
      out[i] = -1;
      continue;
    }
    if (resident != nullptr && resident[i] >= 0) {
      out[i] = resident[i];
      continue;
    }
    bool inserted;
    entry_u[i] = index.find_or_insert(k, static_cast<int32_t>(unique.size()), &inserted);
    if (inserted) unique.push_back(k);
  }
  const int64_t U = static_cast<int64_t>(unique.size());
  // Hit slots by LRU position, as the CUDA kernel finds them: a key's hit slot is the lowest
  // listed slot holding it (a slot the order does not list, on a corrupted state only, is never
  // one). pos_u[p]: the selected key the slot at position p holds (U + p: none, or not a slot).
  const int32_t no_slot = static_cast<int32_t>(H);  // above every slot
  std::vector<int32_t>& slot_of = w.slot_of;
  // slot_of[U + p]: a sink for position p when it holds no selected key (branch-free, and no
  // chain of read-modify-writes through one sink entry)
  slot_of.assign(U + H, no_slot);
  std::vector<int32_t>& pos_u = w.pos_u;
  pos_u.resize(H);
  for (int64_t p = 0; p < H; ++p) {
    const int16_t slot = lru[p];
    const bool valid = slot >= 0 && slot < H;
    const int32_t u = valid ? index.find(slot_keys[slot]) : -1;
    const int32_t uu = static_cast<int32_t>(u >= 0 ? u : U + p);
    pos_u[p] = uu;
    slot_of[uu] = std::min<int32_t>(slot_of[uu], valid ? slot : no_slot);
  }
  // Split the LRU order into evictable and hit slots (branch-free: both lists get every slot,
  // only the right one advances).
  std::vector<int16_t>& evictable = w.evictable;
  std::vector<int16_t>& hits_in_order = w.hits_in_order;
  evictable.resize(H + 1);
  hits_in_order.resize(H + 1);
  int64_t ne = 0, nh = 0;
  for (int64_t p = 0; p < H; ++p) {
    const int16_t slot = lru[p];
    const bool valid = slot >= 0 && slot < H;
    const bool hit = valid & (pos_u[p] < U) & (slot_of[pos_u[p]] == slot);
    evictable[ne] = slot;
    hits_in_order[nh] = slot;
    ne += valid && !hit;
    nh += hit;
  }
  for (int64_t u = 0; u < U; ++u) slot_of[u] = slot_of[u] == no_slot ? -1 : slot_of[u];
  evictable.resize(ne);
  hits_in_order.resize(nh);
  // Misses in first-occurrence order (compacted branch-free); the m-th takes evictable[m]
  // (fewer evictable slots than misses happens on a corrupted LRU only).
  RowCounts c;
  std::vector<int32_t>& miss_u = w.miss_u;
  miss_u.resize(U + 1);
  int64_t nm = 0;
  for (int64_t u = 0; u < U; ++u) {
    miss_u[nm] = static_cast<int32_t>(u);
    nm += slot_of[u] < 0;
  }
  c.hits = static_cast<uint64_t>(U - nm);
  const int64_t M = std::min<int64_t>(nm, static_cast<int64_t>(evictable.size()));
  int64_t m = 0;
  for (; m < M; ++m) {
    const int64_t u = miss_u[m];
    const int16_t slot = evictable[m];
    slot_of[u] = slot;
    slot_keys[slot] = unique[u];
    miss_src[m] = unique[u];
    miss_dst[m] = static_cast<int32_t>(row_base + slot);
  }
  c.misses = static_cast<uint64_t>(m);
  for (int64_t i = 0; i < K; ++i) {
    const int32_t u = entry_u[i];
    if (u >= 0) out[i] = slot_of[u] >= 0 ? static_cast<int32_t>(row_base + slot_of[u]) : -1;
  }
  // New order: untaken evictable, newly filled (miss order), hits (previous order).
  int64_t p = 0;
  for (size_t e = m; e < evictable.size(); ++e) lru[p++] = evictable[e];
  for (int64_t e = 0; e < m; ++e) lru[p++] = evictable[e];
  for (int16_t slot : hits_in_order) lru[p++] = slot;
  return c;
}

// Copies row `s` of view `from` to row `t` of view `to`; false (nothing copied) when either
// row is out of range.
bool copy_row(const RowView& from, int64_t s, const RowView& to, int64_t t) {
  if (s < 0 || s >= from.rows() || t < 0 || t >= to.rows()) return false;
  const uint8_t* a =
      from.base + (s / from.block_size) * from.block_stride + (s % from.block_size) * from.row_stride;
  uint8_t* b = to.base + (t / to.block_size) * to.block_stride + (t % to.block_size) * to.row_stride;
  std::memcpy(b, a, static_cast<size_t>(from.row_bytes));
  return true;
}

}  // namespace

void resolve_residency_cpu(const at::Tensor& top_k, const at::Tensor& state_rows,
                           const c10::optional<at::Tensor>& resident_rows, at::Tensor& slot_keys,
                           at::Tensor& lru, at::Tensor& stats, at::Tensor& out_rows,
                           at::Tensor& miss_src, at::Tensor& miss_dst, at::Tensor& miss_count,
                           const c10::Scalar& num_keys, const c10::Scalar& hot_base) {
  const ResolveDims d =
      check_resolve_args(top_k, state_rows, resident_rows, slot_keys, lru, stats, out_rows,
                         miss_src, miss_dst, miss_count, num_keys, hot_base);
  if (d.B == 0) return;
  const int32_t* keys = top_k.data_ptr<int32_t>();
  const int32_t* srows = state_rows.data_ptr<int32_t>();
  const bool has_res = resident_rows.has_value() && resident_rows->defined();
  const int32_t* res = has_res ? resident_rows->data_ptr<int32_t>() : nullptr;
  int32_t* sk = slot_keys.data_ptr<int32_t>();
  int16_t* order = lru.data_ptr<int16_t>();
  uint64_t* st = stats.data_ptr<uint64_t>();
  int32_t* out = out_rows.data_ptr<int32_t>();
  int32_t* msrc = miss_src.data_ptr<int32_t>();
  int32_t* mdst = miss_dst.data_ptr<int32_t>();
  int32_t* mcount = miss_count.data_ptr<int32_t>();
  const std::vector<char> live = live_rows(srows, d.B, d.S);
  const int64_t K = d.K, H = d.H;

  at::parallel_for(0, d.B, 1, [&](int64_t begin, int64_t end) {
    RowScratch w;
    for (int64_t r = begin; r < end; ++r) {
      int32_t* o = out + r * K;
      if (!live[r]) {
        std::fill(o, o + K, -1);
        mcount[r] = 0;
        continue;
      }
      const int64_t s = srows[r];
      const RowCounts c =
          resolve_row(w, keys + r * K, res ? res + r * K : nullptr, sk + s * H, order + s * H,
                      o, msrc + r * K, mdst + r * K, K, H, d.num_keys, d.hot_base + s * H);
      mcount[r] = static_cast<int32_t>(c.misses);
      __atomic_fetch_add(&st[0], c.hits, __ATOMIC_RELAXED);
      __atomic_fetch_add(&st[1], c.misses, __ATOMIC_RELAXED);
    }
  });
}

void gather_cpu(at::TensorList host, at::TensorList hot, const at::Tensor& miss_src,
                const at::Tensor& miss_dst, const at::Tensor& miss_count,
                const c10::optional<at::Tensor>& moved_bytes) {
  const GatherPlan plan = check_gather_args(
      host, hot, miss_src, miss_dst, miss_count, moved_bytes,
      [](const at::Tensor& t, const std::string& name) {
        TORCH_CHECK(t.device().is_cpu(), "hisparse_gather: argument '", name,
                    "' must be on cpu for the CPU backend, got ", t.device());
      });
  const int32_t* src = miss_src.data_ptr<int32_t>();
  const int32_t* dst = miss_dst.data_ptr<int32_t>();
  const int32_t* count = miss_count.data_ptr<int32_t>();
  const int64_t B = plan.B, K = plan.K;
  uint64_t moved = 0;
  for (size_t l = 0; l < plan.host.size(); ++l) {
    const RowView h = plan.host[l], d = plan.hot[l];
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      uint64_t rows = 0;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t n = std::min<int64_t>(std::max<int32_t>(count[r], 0), K);
        for (int64_t m = 0; m < n; ++m)
          rows += copy_row(h, src[r * K + m], d, dst[r * K + m]) ? 1 : 0;
      }
      __atomic_fetch_add(&moved, rows * static_cast<uint64_t>(h.row_bytes), __ATOMIC_RELAXED);
    });
  }
  if (moved_bytes.has_value() && moved_bytes->defined())
    __atomic_fetch_add(moved_bytes->data_ptr<uint64_t>(), moved, __ATOMIC_RELAXED);
}

void save_rows_cpu(at::TensorList src, at::TensorList host, const at::Tensor& src_rows,
                   const at::Tensor& host_rows, const c10::optional<at::Tensor>& moved_bytes) {
  const SavePlan plan = check_save_args(
      src, host, src_rows, host_rows, moved_bytes,
      [](const at::Tensor& t, const std::string& name) {
        TORCH_CHECK(t.device().is_cpu(), "hisparse_save_rows: argument '", name,
                    "' must be on cpu for the CPU backend, got ", t.device());
      });
  const int32_t* from = src_rows.data_ptr<int32_t>();
  const int32_t* to = host_rows.data_ptr<int32_t>();
  uint64_t moved = 0;
  for (size_t l = 0; l < plan.src.size(); ++l) {
    const RowView s = plan.src[l], h = plan.host[l];
    at::parallel_for(0, plan.N, 256, [&](int64_t begin, int64_t end) {
      uint64_t rows = 0;
      for (int64_t i = begin; i < end; ++i) rows += copy_row(s, from[i], h, to[i]) ? 1 : 0;
      __atomic_fetch_add(&moved, rows * static_cast<uint64_t>(s.row_bytes), __ATOMIC_RELAXED);
    });
  }
  if (moved_bytes.has_value() && moved_bytes->defined())
    __atomic_fetch_add(moved_bytes->data_ptr<uint64_t>(), moved, __ATOMIC_RELAXED);
}

void invalidate_cpu(at::Tensor& slot_keys, at::Tensor& lru, const at::Tensor& state_rows,
                    const c10::optional<at::Tensor>& keys) {
  const InvalidateDims d = check_invalidate_args(slot_keys, lru, state_rows, keys);
  int32_t* sk = slot_keys.data_ptr<int32_t>();
  int16_t* order = lru.data_ptr<int16_t>();
  const int32_t* srows = state_rows.data_ptr<int32_t>();
  const bool by_key = keys.has_value() && keys->defined();
  const int32_t* ks = by_key ? keys->data_ptr<int32_t>() : nullptr;
  for (int64_t i = 0; i < d.N; ++i) {
    const int64_t s = srows[i];
    if (s < 0 || s >= d.S) continue;
    int32_t* row = sk + s * d.H;
    if (!by_key) {
      std::fill(row, row + d.H, -1);
      for (int64_t j = 0; j < d.H; ++j) order[s * d.H + j] = static_cast<int16_t>(j);
      continue;
    }
    const int32_t k = ks[i];
    if (k < 0) continue;
    for (int64_t j = 0; j < d.H; ++j)
      if (row[j] == k) row[j] = -1;
  }
}

namespace {

// The CUDA kernel's order-preserving key (topk_slots.cu): -0.0 ties with +0.0.
uint32_t order_key(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace

void topk_slots_cpu(const at::Tensor& scores, const at::Tensor& req,
                    const at::Tensor& block_table, const c10::Scalar& block_size,
                    at::Tensor& out) {
  const TopkSlotsDims d = check_topk_slots_args(scores, req, block_table, block_size, out);
  if (d.T == 0 || d.K == 0) return;
  const float* sc = scores.data_ptr<float>();
  const bool req64 = req.scalar_type() == at::kLong, bt64 = block_table.scalar_type() == at::kLong;
  const int64_t* r64 = req64 ? req.data_ptr<int64_t>() : nullptr;
  const int32_t* r32 = req64 ? nullptr : req.data_ptr<int32_t>();
  const int64_t* b64 = bt64 ? block_table.data_ptr<int64_t>() : nullptr;
  const int32_t* b32 = bt64 ? nullptr : block_table.data_ptr<int32_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, d.T, 1, [&](int64_t begin, int64_t end) {
    std::vector<std::pair<uint32_t, int64_t>> cand;
    for (int64_t t = begin; t < end; ++t) {
      int64_t* row_out = o + t * d.K;
      const int64_t r = r64 ? r64[t] : int64_t(r32[t]);
      int64_t n = 0;
      if (r >= 0 && r < d.R) {
        cand.clear();
        const float* row = sc + t * d.ld;
        for (int64_t p = 0; p < d.L; ++p)
          if (row[p] > -std::numeric_limits<float>::infinity())  // NaN and -inf: no candidates
            cand.emplace_back(order_key(row[p]), p);
        // the K largest keys, the lower position first among equal keys
        auto better = [](const auto& a, const auto& b) {
          return a.first != b.first ? a.first > b.first : a.second < b.second;
        };
        if (static_cast<int64_t>(cand.size()) > d.K) {
          std::nth_element(cand.begin(), cand.begin() + d.K, cand.end(), better);
          cand.resize(d.K);
        }
        std::sort(cand.begin(), cand.end(),
                  [](const auto& a, const auto& b) { return a.second < b.second; });
        const int64_t bs = d.block_size;
        for (const auto& c : cand) {
          const int64_t p = c.second;
          const int64_t blk = b64 ? b64[r * d.W + p / bs] : int64_t(b32[r * d.W + p / bs]);
          row_out[n++] = blk * bs + p % bs;
        }
      }
      std::fill(row_out + n, row_out + d.K, int64_t(-1));
    }
  });
}

}  // namespace hisparse
