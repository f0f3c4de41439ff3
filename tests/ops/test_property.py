"""Property tests: the C++ CPU ops against the Python oracle over random multi-step workloads."""

from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse import ops
from tests import oracle
from tests.helpers import new_state, run_resolve, stats_list


@st.composite
def workloads(draw):
    K = draw(st.integers(1, 6))
    H = draw(st.integers(K, K + 6))
    S = draw(st.integers(1, 4))
    num_keys = draw(st.integers(1, 3 * H))
    hot_base = draw(st.sampled_from([0, 5, 1000]))
    resident = draw(st.booleans())
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["resolve", "resolve", "resolve", "reset", "drop"]))
        if kind == "resolve":
            B = draw(st.integers(0, 4))
            state_rows = draw(st.lists(st.integers(-2, S), min_size=B, max_size=B))
            keys = st.integers(-2, num_keys + 1)
            top_k = draw(st.lists(st.lists(keys, min_size=K, max_size=K), min_size=B, max_size=B))
            res = None
            if resident:
                res = draw(
                    st.lists(
                        st.lists(st.sampled_from([-1, -1, -1, 7, 900]), min_size=K, max_size=K),
                        min_size=B,
                        max_size=B,
                    )
                )
            steps.append(("resolve", state_rows, top_k, res))
        elif kind == "reset":
            steps.append(("reset", draw(st.lists(st.integers(-1, S), max_size=3)), None, None))
        else:
            n = draw(st.integers(0, 4))
            rows = draw(st.lists(st.integers(-1, S), min_size=n, max_size=n))
            keys = draw(st.lists(st.integers(-1, num_keys), min_size=n, max_size=n))
            steps.append(("drop", rows, keys, None))
    return K, H, S, num_keys, hot_base, steps


def _i32(x, shape=None):
    t = torch.tensor(x, dtype=torch.int32)
    return t.reshape(shape) if shape is not None else t


def check_against_oracle(K, H, S, num_keys, hot_base, steps):
    slot_keys, lru, stats = new_state(S, H)
    o_keys = [[-1] * H for _ in range(S)]
    o_lru = [list(range(H)) for _ in range(S)]
    o_stats = [0, 0]
    for kind, rows, arg, res in steps:
        if kind == "resolve":
            B = len(rows)
            res_t = _i32(res, (B, K)) if res is not None else None
            out, src, dst, count = run_resolve(
                _i32(arg, (B, K)),
                _i32(rows, (B,)),
                slot_keys,
                lru,
                stats,
                num_keys=num_keys,
                hot_base=hot_base,
                resident_rows=res_t,
            )
            e_out, e_src, e_dst, e_count = oracle.resolve(
                arg,
                rows,
                o_keys,
                o_lru,
                o_stats,
                num_keys=num_keys,
                hot_base=hot_base,
                resident_rows=res,
            )
            assert out.tolist() == (e_out if B else [])
            assert count.tolist() == e_count
            for r in range(B):
                n = e_count[r]
                assert src[r, :n].tolist() == e_src[r]
                assert dst[r, :n].tolist() == e_dst[r]
        elif kind == "reset":
            ops.invalidate(slot_keys, lru, _i32(rows, (len(rows),)))
            oracle.invalidate(o_keys, o_lru, rows)
        else:
            ops.invalidate(slot_keys, lru, _i32(rows, (len(rows),)), _i32(arg, (len(arg),)))
            oracle.invalidate(o_keys, o_lru, rows, arg)
        assert slot_keys.tolist() == o_keys
        assert lru.tolist() == o_lru
        assert stats_list(stats) == o_stats


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_resolve_and_invalidate_match_oracle(w):
    check_against_oracle(*w)


def test_long_random_workload_matches_oracle():
    """Realistic sizes: drifting selections, evictions, state-row reuse."""
    rng = random.Random(7)
    K, H, S, num_keys = 64, 128, 6, 2000
    steps = []
    windows = [rng.randrange(num_keys - 400) for _ in range(S)]
    for step in range(40):
        rows = rng.sample(range(S), 4) + [-1]
        top_k = []
        for s in rows:
            lo = windows[max(s, 0)]
            top_k.append([lo + rng.randrange(300) for _ in range(K)])
            windows[max(s, 0)] += rng.randrange(8)
        steps.append(("resolve", rows, top_k, None))
        if step % 9 == 8:
            steps.append(("reset", [rng.randrange(S)], None, None))
        if step % 5 == 4:
            steps.append(("drop", [rows[0]], [top_k[0][0]], None))
    check_against_oracle(K, H, S, num_keys, 3, steps)


def test_hits_after_repeat_and_lru_order_example():
    """A worked example of the spec (docs/ops.md), checked by hand."""
    slot_keys, lru, stats = new_state(1, 4)
    run_resolve(_i32([[10, 11]]), _i32([0]), slot_keys, lru, stats, num_keys=100)
    # misses 10, 11 took slots 0, 1; LRU = unused evictable (2, 3) then filled (0, 1)
    assert slot_keys.tolist() == [[10, 11, -1, -1]]
    assert lru.tolist() == [[2, 3, 0, 1]]
    out, src, dst, count = run_resolve(
        _i32([[11, 12, 12]]), _i32([0]), slot_keys, lru, stats, num_keys=100
    )
    # 11 hits slot 1; 12 misses into the oldest evictable slot 2; duplicates share it
    assert out.tolist() == [[1, 2, 2]]
    assert count.tolist() == [1] and src[0, :1].tolist() == [12] and dst[0, :1].tolist() == [2]
    assert lru.tolist() == [[3, 0, 2, 1]]
    assert stats_list(stats) == [1, 3]


def test_slot_missing_from_a_corrupted_lru_is_never_a_hit_slot():
    """On a corrupted LRU only the listed slots can be hit slots, as the oracle says."""
    slot_keys, lru, stats = new_state(1, 4)
    slot_keys[0] = _i32([10, 11, 12, -1])
    lru[0] = torch.tensor([0, 0, 2, 3], dtype=torch.int16)  # slot 1 unlisted, slot 0 twice
    o_keys, o_lru, o_stats = slot_keys.tolist(), lru.tolist(), [0, 0]
    out, src, dst, count = run_resolve(
        _i32([[11, 12, 10]]), _i32([0]), slot_keys, lru, stats, num_keys=100
    )
    want = oracle.resolve([[11, 12, 10]], [0], o_keys, o_lru, o_stats, num_keys=100, hot_base=0)
    # 11 sits in the unlisted slot 1: a miss, taking the first evictable listed slot (3)
    assert out.tolist() == want[0] == [[3, 2, 0]]
    assert count.tolist() == want[3] == [1] and src[0, :1].tolist() == want[1][0] == [11]
    assert slot_keys.tolist() == o_keys == [[10, 11, 12, 11]]
    assert lru.tolist() == o_lru and stats_list(stats) == o_stats == [2, 1]


@st.composite
def gather_cases(draw):
    L = draw(st.integers(1, 4))
    row_bytes = draw(st.sampled_from([16, 32, 48]))
    block_size = draw(st.sampled_from([1, 2, 4]))
    host_blocks = draw(st.integers(1, 6))
    hot_rows = draw(st.integers(1, 12))
    B = draw(st.integers(0, 3))
    K = draw(st.integers(1, 5))
    n_host = host_blocks * block_size
    src = draw(
        st.lists(
            st.lists(st.integers(-2, n_host + 1), min_size=K, max_size=K), min_size=B, max_size=B
        )
    )
    dst = draw(
        st.lists(
            st.lists(st.integers(-2, hot_rows + 1), min_size=K, max_size=K), min_size=B, max_size=B
        )
    )
    count = draw(st.lists(st.integers(-1, K + 2), min_size=B, max_size=B))
    return L, row_bytes, block_size, host_blocks, hot_rows, B, K, src, dst, count


@settings(max_examples=200, deadline=None)
@given(gather_cases(), st.integers(0, 2**31))
def test_gather_group_matches_oracle(case, seed):
    L, row_bytes, block_size, host_blocks, hot_rows, B, K, src, dst, count = case
    g = torch.Generator().manual_seed(seed)
    hosts = [
        torch.randint(0, 256, (host_blocks, block_size, row_bytes), dtype=torch.uint8, generator=g)
        for _ in range(L)
    ]
    hots = [
        torch.randint(0, 256, (hot_rows, row_bytes), dtype=torch.uint8, generator=g)
        for _ in range(L)
    ]
    expected_hot = []
    expected_moved = 0
    for host, hot in zip(hosts, hots):
        host_rows = [bytes(r) for r in host.reshape(-1, row_bytes).tolist()]
        o_hot = [bytes(r) for r in hot.tolist()]
        expected_moved += oracle.gather(host_rows, o_hot, src, dst, count)
        expected_hot.append(o_hot)
    moved = torch.zeros(1, dtype=torch.uint64)
    ops.gather(hosts, hots, _i32(src, (B, K)), _i32(dst, (B, K)), _i32(count, (B,)), moved)
    for hot, o_hot in zip(hots, expected_hot):
        assert [bytes(r) for r in hot.tolist()] == o_hot
    assert int(moved[0]) == expected_moved
