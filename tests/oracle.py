"""A slow, obviously-correct Python model of the hisparse ops (docs/ops.md), for tests only.

State and inputs are plain nested lists; each function mirrors one numbered rule of the spec.
"""

from __future__ import annotations

from hisparse.runtime import empty_residency


def empty_state(S, H):
    """``(slot_keys, lru)`` as lists, from the library's own constructor: the oracle's invalidate
    resets rows with it, so comparing invalidate against the kernels checks the constructor too."""
    slot_keys, lru = empty_residency(S, H)
    return slot_keys.tolist(), lru.tolist()


def resolve(top_k, state_rows, slot_keys, lru, stats, *, num_keys, hot_base, resident_rows=None):
    """Returns (out_rows, miss_src, miss_dst, miss_count); mutates slot_keys, lru, stats."""
    H = len(slot_keys[0]) if slot_keys else 0
    S = len(slot_keys)
    out_rows, miss_src, miss_dst, miss_count = [], [], [], []
    seen_state = set()
    for r, row in enumerate(top_k):
        s = state_rows[r]
        # Rule 0: padding rows and later duplicates of a state row.
        if not (0 <= s < S) or s in seen_state:
            out_rows.append([-1] * len(row))
            miss_src.append([])
            miss_dst.append([])
            miss_count.append(0)
            continue
        seen_state.add(s)
        base = hot_base + s * H
        out = [None] * len(row)
        selected = []  # distinct non-resident keys, first-occurrence order
        for i, key in enumerate(row):
            if not (0 <= key < num_keys):  # rule 1
                out[i] = -1
            elif resident_rows is not None and resident_rows[r][i] >= 0:  # rule 2
                out[i] = resident_rows[r][i]
            elif key not in selected:
                selected.append(key)
        keys_of_s = slot_keys[s]
        listed = sorted({j for j in lru[s] if 0 <= j < H})  # every slot, unless corrupted
        hit_slot = {}
        for key in selected:  # rule 3: lowest listed slot holding the key
            for j in listed:
                if keys_of_s[j] == key:
                    hit_slot[key] = j
                    break
        taken_by_hits = set(hit_slot.values())
        order = [j for j in lru[s] if 0 <= j < H]
        evictable = [j for j in order if j not in taken_by_hits]  # rule 4
        misses = [key for key in selected if key not in hit_slot]
        slot_of = dict(hit_slot)
        src, dst = [], []
        filled = []
        for m, key in enumerate(misses):
            if m >= len(evictable):
                break
            j = evictable[m]
            keys_of_s[j] = key
            slot_of[key] = j
            filled.append(j)
            src.append(key)
            dst.append(base + j)
        for i, key in enumerate(row):
            if out[i] is None:
                out[i] = base + slot_of[key] if key in slot_of else -1
        # Rule 5.
        new_order = evictable[len(filled) :] + filled + [j for j in order if j in taken_by_hits]
        lru[s][: len(new_order)] = new_order
        stats[0] += len(hit_slot)
        stats[1] += len(filled)
        out_rows.append(out)
        miss_src.append(src)
        miss_dst.append(dst)
        miss_count.append(len(filled))
    return out_rows, miss_src, miss_dst, miss_count


def gather(host_rows, hot_rows, miss_src, miss_dst, miss_count):
    """host_rows/hot_rows: lists of bytes per row (hot mutated). Returns bytes moved."""
    moved = 0
    for r, n in enumerate(miss_count):
        for m in range(max(0, min(n, len(miss_src[r])))):
            s, d = miss_src[r][m], miss_dst[r][m]
            if 0 <= s < len(host_rows) and 0 <= d < len(hot_rows):
                hot_rows[d] = host_rows[s]
                moved += len(host_rows[s])
    return moved


def save_rows(src_rows_bytes, host_rows_bytes, src_rows, host_rows):
    """src_rows_bytes/host_rows_bytes: lists of bytes per row (host mutated). Returns bytes moved.

    Entry i copies source row src_rows[i] to host row host_rows[i]; out-of-range entries are
    skipped. (Host rows are distinct among copied entries by contract.)
    """
    moved = 0
    for s, d in zip(src_rows, host_rows):
        if 0 <= s < len(src_rows_bytes) and 0 <= d < len(host_rows_bytes):
            host_rows_bytes[d] = src_rows_bytes[s]
            moved += len(src_rows_bytes[s])
    return moved


def invalidate(slot_keys, lru, state_rows, keys=None):
    S = len(slot_keys)
    for i, s in enumerate(state_rows):
        if not 0 <= s < S:
            continue
        H = len(slot_keys[s])
        if keys is None:
            (slot_keys[s],), (lru[s],) = empty_state(1, H)
        elif keys[i] >= 0:
            slot_keys[s] = [-1 if k == keys[i] else k for k in slot_keys[s]]


def topk_slots(scores, req, block_table, block_size, k):
    """scores: list of float rows; req: ints; block_table: list of int rows. Returns [T][k]: per
    token the k highest scores above -inf (lower position first among equal ones; NaN never),
    as slots in ascending position order, then -1."""
    out = []
    for t, row in enumerate(scores):
        r = req[t]
        chosen = []
        if 0 <= r < len(block_table):
            cand = [(-v, p) for p, v in enumerate(row) if v > float("-inf")]
            chosen = sorted(p for _, p in sorted(cand)[:k])
        slots = [block_table[r][p // block_size] * block_size + p % block_size for p in chosen]
        out.append(slots + [-1] * (k - len(slots)))
    return out
