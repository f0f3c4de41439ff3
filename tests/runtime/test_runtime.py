"""Runtime: index groups with followers, exact bytes, reset, release, host pool sizing."""

from __future__ import annotations

import pytest
import torch

from hisparse.runtime import HiSparseIndexGroup, HiSparseRuntime
from hisparse.runtime.host_pool import HostPool, HostPoolError, available_host_bytes
from hisparse.runtime.views import BindingError, PackedLayout, bind_layers
from tests import oracle

S, H, K, ROWS, RB = 3, 8, 4, 64, 32


def make_group(num_layers=4, row_bytes=RB):
    layout = PackedLayout(
        tuple(f"layer{i}" for i in range(num_layers)),
        num_blocks=ROWS // 4,
        block_size=4,
        row_bytes=row_bytes,
    )
    raw = torch.randint(
        0, 256, (layout.nbytes(),), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    hosts = bind_layers(raw, layout)
    g = HiSparseIndexGroup(
        "g0", num_state_rows=S, hot_size=H, top_k=K, max_batch=4, num_keys=ROWS, device="cpu"
    )
    rts = [
        HiSparseRuntime(name, g, view, torch.zeros(S * H, row_bytes, dtype=torch.uint8))
        for name, view in hosts.items()
    ]
    return g, rts


def step(g, rts, top_k, state_rows):
    out = rts[0].resolve(
        torch.tensor(top_k, dtype=torch.int32), torch.tensor(state_rows, dtype=torch.int32)
    )
    for rt in rts:
        rt.gather()
        rt.wait_ready()
    return out


def test_every_member_serves_its_own_rows_and_bytes_are_exact():
    g, rts = make_group()
    assert rts[0].is_leader and not rts[1].is_leader
    assert g.stats_row_bytes == 4 * RB
    workload = [
        ([[1, 2, 3, 4], [9, 9, 10, 11]], [0, 2]),
        ([[2, 3, 4, 5], [9, 10, 11, 12]], [0, 2]),
        ([[40, 41, 42, 43], [-1, 9, 60, 61]], [0, 2]),
    ]
    true_misses = 0
    for top_k, rows in workload:
        out = step(g, rts, top_k, rows)
        true_misses += int(g.miss_count[: len(rows)].sum())
        for rt in rts:
            host_rows = rt.host_view.reshape(-1, RB)
            for r, keys in enumerate(top_k):
                for i, key in enumerate(keys):
                    if key < 0:
                        assert int(out[r, i]) == -1
                        continue
                    assert torch.equal(rt.hot_view[int(out[r, i])], host_rows[key])
    hits, misses, moved = (int(x) for x in g.counters.tolist())
    assert misses == true_misses == 4 + 3 + 1 + 1 + 4 + 2
    assert moved == misses * 4 * RB


def test_a_custom_copy_moves_the_rows_and_its_bytes_are_counted():
    """gather(copy=...) swaps the op's copy for the caller's; hot rows and counters come out as
    the op's gather leaves them."""
    calls = []

    def copy(host, hot, miss_src, miss_dst, miss_count):
        calls.append(int(miss_count.sum()))
        rows = host.reshape(-1, hot.shape[-1])
        for b in range(miss_count.shape[0]):
            n = int(miss_count[b])
            hot[miss_dst[b, :n].long()] = rows[miss_src[b, :n].long()]

    workload = [([[1, 2, 3, 4], [9, 9, 10, 11]], [0, 2]), ([[2, 3, 4, 5], [9, 10, 11, 12]], [0, 2])]
    (g, rts), (g_op, rts_op) = make_group(), make_group()
    for top_k, rows in workload:
        state = torch.tensor(rows, dtype=torch.int32)
        rts[0].resolve(torch.tensor(top_k, dtype=torch.int32), state)
        for rt in rts:
            rt.gather(copy=copy)
        step(g_op, rts_op, top_k, rows)
    assert sum(calls) > 0 and len(calls) == 4 * len(workload)
    for rt, rt_op in zip(rts, rts_op):
        assert torch.equal(rt.hot_view, rt_op.hot_view)
    assert g.counters.tolist() == g_op.counters.tolist()
    assert int(g.counters[2]) == int(g.counters[1]) * 4 * RB


def test_followers_cannot_resolve():
    g, rts = make_group(2)
    with pytest.raises(RuntimeError, match="follower"):
        rts[1].resolve(torch.zeros(1, K, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))


def test_release_makes_reused_state_row_miss_again():
    g, rts = make_group(1)
    step(g, rts, [[1, 2, 3, 4]], [1])
    step(g, rts, [[1, 2, 3, 4]], [1])
    assert g.counters[:2].tolist() == [4, 4]
    g.release([1])
    step(g, rts, [[1, 2, 3, 4]], [1])
    assert g.counters[:2].tolist() == [4, 8]


def test_invalidate_keys_forces_recopy_of_rewritten_row():
    g, rts = make_group(1)
    step(g, rts, [[1, 2, 3, 4]], [0])
    rts[0].host_view.reshape(-1, RB)[3].fill_(77)  # position rewritten on the host
    g.invalidate_keys([0], [3])
    out = step(g, rts, [[1, 2, 3, 4]], [0])
    assert bool((rts[0].hot_view[int(out[0, 2])] == 77).all())


def test_group_matches_oracle():
    g, rts = make_group(4)
    o_keys, o_lru = oracle.empty_state(S, H)
    o_stats = [0, 0]
    hot_o = [[bytes(RB)] * (S * H) for _ in rts]
    host_o = [[bytes(r) for r in rt.host_view.reshape(-1, RB).tolist()] for rt in rts]
    gen = torch.Generator().manual_seed(3)
    for _ in range(12):
        top_k = torch.randint(0, 20, (3, K), generator=gen, dtype=torch.int32)
        rows = [0, 1, 2]
        step(g, rts, top_k.tolist(), rows)
        _, src, dst, cnt = oracle.resolve(
            top_k.tolist(), rows, o_keys, o_lru, o_stats, num_keys=ROWS, hot_base=0
        )
        for lo, ho in zip(host_o, hot_o):
            oracle.gather(lo, ho, src, dst, cnt)
    for rt, ho in zip(rts, hot_o):
        assert [bytes(r) for r in rt.hot_view.tolist()] == ho
    assert g.counters[:2].tolist() == o_stats


def test_runtime_rejects_mismatched_views():
    g, _ = make_group(1)
    host = torch.zeros(ROWS, RB, dtype=torch.uint8)
    with pytest.raises(BindingError, match="differ in size"):
        HiSparseRuntime("x", g, host, torch.zeros(S * H, 2 * RB, dtype=torch.uint8))
    with pytest.raises(BindingError, match="hot view has"):
        HiSparseRuntime("x", g, host, torch.zeros(S * H - 1, RB, dtype=torch.uint8))
    with pytest.raises(BindingError, match="host view has"):
        HiSparseRuntime("x", g, host[:10], torch.zeros(S * H, RB, dtype=torch.uint8))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(hot_size=2), "top_k <= hot_size"),
        (dict(hot_size=40000, top_k=4), "top_k <= hot_size"),
        (dict(max_batch=0), "max_batch"),
        (dict(num_state_rows=-1), "num_state_rows"),
        (dict(hot_base=2**31), "hot_base"),
    ],
)
def test_group_rejects_bad_config(kwargs, match):
    base = dict(num_state_rows=2, hot_size=8, top_k=4, max_batch=2, num_keys=10, device="cpu")
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        HiSparseIndexGroup("g", **base)


def test_group_rejects_bad_step_inputs():
    g, rts = make_group(1)
    with pytest.raises(ValueError, match="exceeds max_batch"):
        g.resolve(torch.zeros(5, K, dtype=torch.int32), torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"shape \[B, 4\]"):
        g.resolve(torch.zeros(1, K + 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="state_rows must lie"):
        g.release([S])


def test_host_pool_checks_available_ram():
    with pytest.raises(HostPoolError, match="lower host_pool_gib"):
        HostPool(available_host_bytes() + 2**30, pin=False)
    with pytest.raises(HostPoolError, match="positive"):
        HostPool(0, pin=False)
    pool = HostPool(4096, pin=False)
    assert pool.raw.numel() == 4096 and not pool.pinned
    pool.release()
    pool.release()
    assert pool.released


def test_deferred_misses_count_the_gathers_bytes_and_copy_nothing():
    from hisparse.runtime.miss_plan import defer_misses

    g, rts = make_group(num_layers=2)
    gathered_g, gathered = make_group(num_layers=2)
    top_k, rows = [[1, 2, 3, 4], [9, 9, 10, -1]], [0, 2]
    for members in (rts, gathered):
        members[0].resolve(
            torch.tensor(top_k, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32)
        )
    hot_before = [rt.hot_view.clone() for rt in rts]
    plans = [defer_misses(rt) for rt in rts]
    for rt in gathered:
        rt.gather()
    assert int(g.moved_bytes.view(torch.int64)) == int(gathered_g.moved_bytes.view(torch.int64))
    assert (
        int(g.moved_bytes.view(torch.int64)) == 2 * 6 * RB
    )  # 4 + 2 keys (one repeated, one padding), 2 layers
    for rt, before, plan in zip(rts, hot_before, plans):
        assert torch.equal(rt.hot_view, before), "a deferred plan must leave the copy to the read"
        assert plan.host is rt.host_rows_view
        assert plan.pending.shape == (S * H,) and bool((plan.pending == -1).all())
        src, dst, count = plan.src, plan.dst, plan.count
        assert count.tolist() == [4, 2]
        # the plan names exactly the rows the gather filled, with the host rows' bytes
        for b in range(2):
            for j in range(int(count[b])):
                want = rt.host_rows_view[int(src[b, j])]
                assert torch.equal(gathered[rts.index(rt)].hot_view[int(dst[b, j])], want)
    assert plans[0].pending is plans[1].pending, "one table per index group"
