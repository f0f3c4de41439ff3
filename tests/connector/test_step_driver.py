"""StepDriver with a real registration on the CPU, fed hand-built metadata: resets and
invalidations reach every group, each group resolves once and each layer gathers once, batch rows
find their state rows through the anchors, and the hot buffers hold, bit for bit, the rows the
oracle (tests/oracle.py) says, with the resident rows below ``hot_base`` untouched."""

from __future__ import annotations

import random

import pytest
import torch

from hisparse.connector.metadata import HiSparseConnectorMetadata
from hisparse.connector.step_driver import StepDriver
from tests import oracle
from tests.helpers import cpu_registration, fill_host_rows

LAYERS = ("l0", "l1", "l2", "l3")
S, H, K, HOST_ROWS, RESIDENT = 3, 4, 3, 24, 2


def _driver(seed=0):
    """Groups [l0, l1] and [l2, l3] with rows of 16, 32, 16 and 48 bytes, random host rows."""
    cfg, reg, caches = cpu_registration(
        LAYERS, (16, 32, 16, 48), S=S, H=H, K=K, host_rows=HOST_ROWS, index_share=2,
        extra_rows=RESIDENT,
    )  # fmt: skip
    fill_host_rows(reg, seed)
    return StepDriver(cfg, reg), reg


def _meta(rows, resets=(), invalidate=(), anchors=(), in_use=0):
    rids = tuple(f"r{r}" for r in rows)
    return HiSparseConnectorMetadata(
        req_ids=rids,
        state_rows=tuple(rows),
        reset_rows=tuple(resets),
        invalidate=tuple(invalidate),
        anchors=tuple(anchors),
        host_rows_in_use=in_use,
    )


def _top(rows):
    return torch.tensor(rows, dtype=torch.int32)


def _resolve_all(d, reg, top, state_rows=None):
    """Every layer in order, as the model calls them: {layer: out_rows}."""
    return {n: d.resolve(reg.runtimes[n], top, None, state_rows).clone() for n in LAYERS}


def _count_calls(monkeypatch, obj, name, log, key):
    real = getattr(obj, name)

    def counted(*args, **kwargs):
        log[key] = log.get(key, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)


def test_each_group_resolves_once_and_each_layer_gathers_once(monkeypatch):
    d, reg = _driver()
    calls: dict = {}
    for g in reg.groups:
        _count_calls(monkeypatch, g, "resolve", calls, g.name)
    for n, rt in reg.runtimes.items():
        _count_calls(monkeypatch, rt, "gather", calls, n)
    d.start(_meta([0, 2]))
    top = _top([[1, 2, 3], [4, 4, -1]])  # 3 + 1 distinct keys: all misses, once each
    out = _resolve_all(d, reg, top)
    again = d.resolve(reg.runtimes["l3"], None, None, None)  # a repeated follower call
    assert calls == {"group0:l0": 1, "group1:l2": 1, "l0": 1, "l1": 1, "l2": 1, "l3": 1}
    assert torch.equal(again, out["l2"]) and torch.equal(out["l0"], out["l1"])
    # exact bytes: 4 misses of every member's row, counted once per layer
    assert [g.moved_bytes.item() for g in reg.groups] == [4 * 48, 4 * 64]
    assert [g.stats.tolist() for g in reg.groups] == [[0, 4], [0, 4]]
    with pytest.raises(RuntimeError, match="'l0' already resolved this step"):
        d.resolve(reg.runtimes["l0"], top, None, None)


def test_followers_wait_for_their_leader_and_nothing_resolves_after_the_step_ends():
    d, reg = _driver()
    d.start(_meta([0]))
    with pytest.raises(RuntimeError, match="'l3' follows 'l2', which has not resolved"):
        d.resolve(reg.runtimes["l3"], None, None, None)
    _resolve_all(d, reg, _top([[1, 2, 3]]))
    d.end()
    with pytest.raises(RuntimeError, match="'l0' resolves after clear_connector_metadata"):
        d.resolve(reg.runtimes["l0"], _top([[1, 2, 3]]), None, None)
    d.start(_meta([0]))  # a new step may resolve again: all three keys are hits now
    _resolve_all(d, reg, _top([[1, 2, 3]]))
    assert reg.groups[0].stats.tolist() == [3, 3]


def test_a_group_whose_follower_skipped_its_gather_is_reset_and_named():
    d, reg = _driver()
    d.start(_meta([0]))
    for n in ("l0", "l2", "l3"):  # l1 never gathers
        d.resolve(reg.runtimes[n], _top([[1, 2, 3]]), None, None)
    with pytest.raises(RuntimeError, match="^layer 'l1' did not gather .* leader 'l0' resolved"):
        d.start(_meta([0]))
    g0, g1 = reg.groups
    assert bool((g0.slot_keys == -1).all())  # nothing stale is left to serve
    assert sorted(g1.slot_keys[0].tolist()) == [-1, 1, 2, 3]  # the complete group keeps its rows
    d.start(_meta([0]))  # the reset group is not named again


def test_start_resets_rows_drops_rewritten_keys_and_pads_the_state_rows():
    d, reg = _driver()
    d.start(_meta([0, 1]))
    _resolve_all(d, reg, _top([[1, 2, 3], [5, 6, 7]]))
    d.start(_meta([1], resets=[0], invalidate=[(1, 6)], in_use=17))
    for g in reg.groups:
        assert g.slot_keys[0].tolist() == [-1] * H and g.lru[0].tolist() == list(range(H))
        assert sorted(g.slot_keys[1].tolist()) == [-1, -1, 5, 7]
    assert d.state_rows.tolist() == [1, -1, -1] and d.state_rows.dtype == torch.int32
    assert d.host_rows_in_use == 17
    _resolve_all(d, reg, _top([[5, 6, 7]]))
    assert reg.groups[1].stats.tolist() == [0 + 2, 6 + 1]  # 6 is gathered again


def _oracle_step(state, reg, top, rows):
    """The oracle's resolve for each group and its gather into each member's hot rows."""
    outs = {}
    for g in reg.groups:
        sk, lru, stats = state[g.name]
        out, src, dst, cnt = oracle.resolve(
            top, rows, sk, lru, stats, num_keys=HOST_ROWS, hot_base=RESIDENT
        )
        for m in g.members:
            host = list(m.host_view.reshape(-1, m.row_bytes))
            state[m.layer_name] += oracle.gather(host, state["hot", m.layer_name], src, dst, cnt)
        outs[g.name] = out
    return outs


def test_hot_buffers_match_the_oracle_bit_for_bit_over_steps_with_churn():
    d, reg = _driver(seed=3)
    rng = random.Random(11)
    state = {g.name: (*oracle.empty_state(S, H), [0, 0]) for g in reg.groups}
    for n, rt in reg.runtimes.items():
        state["hot", n] = list(rt.hot_view.clone())
        state[n] = 0
    for _ in range(8):
        rows = rng.sample(range(S), rng.randint(1, S))
        resets = [r for r in range(S) if rng.random() < 0.2]
        for g in reg.groups:
            oracle.invalidate(*state[g.name][:2], resets)
        d.start(_meta(rows, resets=resets))
        keys = [[rng.choice([-1, *range(HOST_ROWS)]) for _ in range(K)] for _ in rows]
        outs = _oracle_step(state, reg, keys, rows)
        got = _resolve_all(d, reg, _top(keys))
        for n, rt in reg.runtimes.items():
            g = rt.index_group
            assert got[n].tolist() == outs[g.name]
            assert torch.equal(rt.hot_view, torch.stack(state["hot", n]))
            host = rt.host_view.reshape(-1, rt.row_bytes)
            for (b, i), key in _entries(keys):
                if key >= 0:
                    assert torch.equal(rt.hot_view[int(got[n][b, i])], host[key])
            assert g.moved_bytes.item() == sum(state[m.layer_name] for m in g.members)
        for g in reg.groups:
            assert g.stats.tolist() == state[g.name][2]
    for rt in reg.runtimes.values():
        assert int(rt.hot_view[:RESIDENT].sum()) == 0  # the resident rows are never written


def _entries(keys):
    return [((b, i), k) for b, row in enumerate(keys) for i, k in enumerate(row)]


def test_anchors_map_batch_rows_to_state_rows_in_any_order_and_drive_the_resolve():
    d, reg = _driver()
    d.start(_meta([2, 0, 1], anchors=[13, 5, 13]))
    # b and c share an anchor (same cached last token): they get their rows in turn
    rows = d.batch_state_rows(torch.tensor([5, 13, 13]))
    assert rows.tolist() == [0, 2, 1] and rows.dtype == torch.int32
    out = _resolve_all(d, reg, _top([[1, -1, -1], [2, -1, -1], [3, -1, -1]]), rows)["l0"]
    # each batch row's key lands in its own state row's hot rows
    assert [int(out[b, 0]) - RESIDENT for b in range(3)] == [0 * H, 2 * H, 1 * H]
    with pytest.raises(RuntimeError, match=r"batch row 1 ends at key 6, .*\['r0', 'r1', 'r2'\]"):
        d.batch_state_rows(torch.tensor([5, 6]))
    with pytest.raises(ValueError, match="anchor_keys must be a 1-D tensor"):
        d.batch_state_rows(torch.tensor([[5]]))
    with pytest.raises(ValueError, match="request 'r0': anchor key 24 lies outside .* 24 rows"):
        d.start(_meta([0], anchors=[24]))
    d.start(_meta([0, 1], anchors=[3, 4]))
    with pytest.raises(ValueError, match=r"state_rows must have shape \(2,\)"):
        d.resolve(reg.runtimes["l0"], _top([[1, 2, 3]] * 2), None, torch.tensor([0]))


def test_batch_state_rows_needs_a_step_with_anchors():
    d, _ = _driver()
    d.start(_meta([0]))
    with pytest.raises(RuntimeError, match="needs step metadata with anchors"):
        d.batch_state_rows(torch.tensor([5]))


def test_a_step_without_anchors_forgets_the_last_steps():
    d, _ = _driver()
    d.start(_meta([1], anchors=[13]))
    assert d.batch_state_rows(torch.tensor([13])).tolist() == [1]
    d.start(_meta([]))
    with pytest.raises(RuntimeError, match="needs step metadata with anchors"):
        d.batch_state_rows(torch.tensor([13]))


@pytest.mark.parametrize(
    "meta, error, says",
    [
        ({"req_ids": ("a",), "state_rows": (0,)}, TypeError, "must be HiSparseConnectorMetadata"),
        (_meta([0, 1, 2, 0]), ValueError, "batch of 4 requests exceeds max_num_seqs = 3"),
        (_meta([3]), ValueError, r"request 'r3': state row 3 is not in \[0, max_num_seqs = 3\)"),
        (_meta([1, 1]), ValueError, r"distinct, got \(1, 1\)"),
        (_meta([0], in_use=25), ValueError, "hold 25 tokens but the host pool has 24 rows"),
    ],
)
def test_metadata_that_does_not_fit_the_registration_is_refused(meta, error, says):
    d, reg = _driver()
    with pytest.raises(error, match=says):
        d.start(meta)
    assert d.state_rows.tolist() == [-1] * S


def test_a_refused_anchor_leaves_the_step_state_as_it_was():
    """The anchor range is checked with the rest of the metadata, before resets, invalidations
    or the state rows take effect: a refused step changes nothing."""
    d, reg = _driver()
    d.start(_meta([0, 1], anchors=[3, 4]))
    _resolve_all(d, reg, _top([[1, 2, 3], [4, 5, 6]]))
    g = reg.groups[0]
    keys_before, rows_before = g.slot_keys.clone(), d.state_rows.clone()
    with pytest.raises(ValueError, match="anchor key 99 lies outside"):
        d.start(_meta([2], resets=[0], invalidate=[(1, 4)], anchors=[99]))
    assert torch.equal(g.slot_keys, keys_before) and torch.equal(d.state_rows, rows_before)
    assert d.batch_state_rows(torch.tensor([4])).tolist() == [1]


def _share_driver(share: int):
    cfg, reg, _ = cpu_registration(
        LAYERS, (16, 32, 16, 48), S=S, H=H, K=K, host_rows=HOST_ROWS, index_share=share,
        extra_rows=RESIDENT,
    )  # fmt: skip
    fill_host_rows(reg, 0)
    return StepDriver(cfg, reg), reg


@pytest.mark.parametrize("share", [1, 2])
def test_deferred_misses_are_left_to_the_read_counted_and_dropped_next_step(share):
    """One layer per group: each layer's pool rows are contiguous and its plan is left to the
    read. Two: a group's rows are interleaved, which the read cannot stride over, so the layer
    gathers as if nothing was deferred."""
    d, reg = _share_driver(share)
    twin, twin_reg = _share_driver(share)  # the same step, gathered
    top = _top([[1, 2, 3], [4, 4, -1]])
    for drv in (d, twin):
        drv.start(_meta([0, 2]))
    hot_before = {n: rt.hot_view.clone() for n, rt in reg.runtimes.items()}
    for n in LAYERS:
        lead = reg.runtimes[n].is_leader
        d.resolve(reg.runtimes[n], top if lead else None, None, None, defer=True)
        twin.resolve(twin_reg.runtimes[n], top if lead else None, None, None)
    assert [g.moved_bytes.item() for g in reg.groups] == [
        g.moved_bytes.item() for g in twin_reg.groups
    ]
    for n, rt in reg.runtimes.items():
        twin_hot = twin_reg.runtimes[n].hot_view
        assert twin.miss_plan(n) is None  # gathered: nothing left to the read
        plan = d.miss_plan(n)
        if share == 2:
            assert not rt.host_rows_view.is_contiguous() and plan is None
            assert torch.equal(rt.hot_view, twin_hot), f"{n}: the fallback did not gather"
            continue
        assert rt.host_rows_view.is_contiguous() and plan is not None
        assert torch.equal(rt.hot_view, hot_before[n]), f"{n}: a deferred plan copied rows"
        assert plan.host is rt.host_rows_view
        assert plan.count[:2].tolist() == [3, 1]
        for b in range(2):  # the plan's rows are what the gather put in the twin's hot rows
            for j in range(int(plan.count[b])):
                host = rt.host_rows_view[int(plan.src[b, j])]
                assert torch.equal(twin_hot[int(plan.dst[b, j])], host)
    d.start(_meta([0, 2]))
    assert all(d.miss_plan(n) is None for n in LAYERS), "a plan must not outlive its step"
