// The limits the ops' data layout imposes, in one place: validate.h rejects inputs past them,
// the kernels rely on them, and register.cpp exports them so hisparse/limits.py can check its
// copy against the build. Not named limits.h: csrc/ is on the include path, where that name
// would shadow the C library's <limits.h> for every header that includes it.
#pragma once

#include <cstdint>
#include <limits>

namespace hisparse {

// Slot ids and LRU entries are int16, so a state row holds at most 2^15 hot slots.
constexpr int64_t kMaxHotSize = int64_t(std::numeric_limits<int16_t>::max()) + 1;

// Keys, hot rows and plan entries are int32.
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

// Rows move as 16-byte vector words, so row sizes, strides and data pointers are multiples of it.
constexpr int64_t kRowAlign = 16;

static_assert(kMaxHotSize - 1 <= std::numeric_limits<int16_t>::max(),
              "every slot id of a full hot buffer must fit the int16 LRU entries");
// The CUDA resolve packs two counts of at most H (evictable and hit slots; misses and hits)
// into the 16-bit halves of one 32-bit scan word.
static_assert(kMaxHotSize <= 0xFFFF, "a per-row count must fit a packed 16-bit counter");

}  // namespace hisparse
