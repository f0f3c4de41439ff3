"""The connector's vLLM-facing step logic, against vLLM-shaped scheduler outputs (no vLLM needed):
anchors that map batch rows to state rows, rewritten positions invalidated, transactional
metadata, scheduler-side gauges, model-layer discovery and the start-up refusal of stock models.
The same code runs inside a real vLLM server in tests/vllm_conformance/test_vllm_serve.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hisparse.connector.config import HiSparseConfig
from hisparse.connector.worker import HiSparseConnectorWorker
from hisparse.vllm.model_check import HiSparseModelError, find_model_layers, model_hisparse_layers
from tests.helpers import connector_impl, vllm_connector
from tests.helpers import vllm_new_req as _new
from tests.helpers import vllm_output as _out

BS = 4


def _sched(max_num_seqs=4):
    """hisparse's vLLM connector class, scheduler role: it reads vLLM's SchedulerOutput."""
    return vllm_connector(
        {"top_k": 2, "hot_size": 4, "max_num_seqs": max_num_seqs, "block_size": BS},
        role="scheduler",
    )


def test_anchor_is_the_key_of_each_requests_last_scheduled_token():
    s = _sched()
    out = _out({"a": 6, "b": 3}, new=[_new("a", 0, [7, 2]), _new("b", 0, [5])])
    meta = s.build_connector_meta(out)
    assert out.has_sync_kv_loads is True  # state rows bound before the forward
    # a: position 5 -> block 2, offset 1 -> 9; b: position 2 -> block 5 -> 22
    assert meta.anchors == (9, 22)
    assert meta.req_ids == ("a", "b") and len(set(meta.state_rows)) == 2
    # next step: a decodes position 6 (its block list gains nothing), b gets a new block at 3
    meta = s.build_connector_meta(_out({"b": 2, "a": 1}, cached=[("b", 3, [11]), ("a", 6, None)]))
    assert meta.anchors == (44, 10)  # b: pos 4 -> block 11 -> 44; a: pos 6 -> 2*4+2
    assert meta.invalidate == ()


def test_rewritten_positions_are_invalidated_for_their_request():
    s = _sched()
    s.build_connector_meta(_out({"a": 6}, new=[_new("a", 0, [7, 2])]))
    # a speculative step wrote through position 5; vLLM rolls back to 4 and rewrites 4 and 5
    meta = s.build_connector_meta(_out({"a": 2}, cached=[("a", 4, None)]))
    row = meta.state_rows[0]
    assert meta.invalidate == ((row, 8), (row, 9))


def test_a_resumed_request_replaces_its_block_list():
    s = _sched()
    s.build_connector_meta(_out({"a": 4}, new=[_new("a", 0, [1])]))
    meta = s.build_connector_meta(_out({}, preempted={"a"}))
    assert meta.reset_rows  # preemption gives the state row back
    meta = s.build_connector_meta(_out({"a": 5}, cached=[("a", 0, [9, 3])], resumed={"a"}))
    assert meta.anchors == (3 * BS + 0,)


def test_a_failing_step_changes_nothing():
    s = _sched(max_num_seqs=2)
    s.build_connector_meta(_out({"a": 3}, new=[_new("a", 0, [1])]))
    state = s.impl._scheduler
    before = (dict(state.tokens), dict(state.blocks), state.rows.in_use)
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        s.build_connector_meta(
            _out(
                {"b": 2, "c": 2, "a": 1},
                new=[_new("b", 0, [2]), _new("c", 0, [3])],
                cached=[("a", 3, None)],
            )
        )
    assert (dict(state.tokens), dict(state.blocks), state.rows.in_use) == before
    with pytest.raises(ValueError, match="past its 1 blocks"):
        s.build_connector_meta(_out({"a": 9}, cached=[("a", 3, None)]))
    assert (dict(state.tokens), dict(state.blocks), state.rows.in_use) == before


def test_scheduler_gauges_follow_live_requests_and_read_zero_when_idle():
    s = _sched()
    s.impl._scheduler.host_rows = 100
    s.build_connector_meta(_out({"a": 10}, new=[_new("a", 0, [1, 2, 3])]))
    g = s.get_kv_connector_stats()
    assert g.data["host_pool_usage"] == [0.12] and g.data["hot_rows_in_use"] == []
    s.request_finished(SimpleNamespace(request_id="a"), [])
    g = s.get_kv_connector_stats()
    assert g.data["host_pool_usage"] == [0.0] and g.data["hot_rows_in_use"] == [0]
    assert g.totals() == {"hits": 0, "misses": 0, "host_to_device_bytes": 0}


def _worker(S=2, H=4, K=2, rb=16, layers=("l0", "l1")):
    w = HiSparseConnectorWorker(
        HiSparseConfig(top_k=K, hot_size=H, max_num_seqs=S, block_size=BS, index_share=1)
    )
    hot = {n: torch.zeros(S * H, rb, dtype=torch.uint8) for n in layers}
    w.register_kv_caches(hot, host_rows=40, groups=[list(layers)])
    return w


def _meta(req_ids, rows, anchors, resets=()):
    from hisparse.connector.worker import HiSparseConnectorMetadata

    return HiSparseConnectorMetadata(
        req_ids=tuple(req_ids),
        state_rows=tuple(rows),
        reset_rows=tuple(resets),
        anchors=tuple(anchors),
    )


def test_explicit_groups_and_host_rows():
    w = _worker()
    assert w.host_rows == 40 and len(w.groups) == 1
    assert [m.layer_name for m in w.groups[0].members] == ["l0", "l1"]
    with pytest.raises(ValueError, match="every registered layer exactly once"):
        HiSparseConnectorWorker(
            HiSparseConfig(top_k=2, hot_size=4, max_num_seqs=2)
        ).register_kv_caches(
            {"x": torch.zeros(8, 16, dtype=torch.uint8)}, host_rows=8, groups=[["x", "x"]]
        )


def test_batch_state_rows_follow_anchors_in_any_batch_order():
    w = _worker()
    w.start_step(_meta(["a", "b"], [1, 0], [13, 22]))
    assert w.batch_state_rows(torch.tensor([22, 13])).tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="no scheduled request's last token"):
        w.batch_state_rows(torch.tensor([13, 14]))
    w.start_step(_meta(["b"], [0], [23]))  # last step's anchors are forgotten
    with pytest.raises(RuntimeError, match="key 13"):
        w.batch_state_rows(torch.tensor([13]))
    with pytest.raises(ValueError, match="anchor key 40 lies outside"):
        w.start_step(_meta(["b"], [0], [40]))


def test_resolve_with_explicit_state_rows_gathers_rows_of_those_requests():
    w = _worker()
    host0, host1 = w.host_view("l0"), w.host_view("l1")
    host0[:] = torch.arange(40, dtype=torch.uint8).unsqueeze(1)
    host1[:] = 100 + torch.arange(40, dtype=torch.uint8).unsqueeze(1)
    w.start_step(_meta(["a", "b"], [1, 0], [5, 9]))
    rows = w.batch_state_rows(torch.tensor([9, 5]))  # batch order b, a
    top = torch.tensor([[3, 9], [5, 1]], dtype=torch.int32)
    where = w.resolve("l0", top, state_rows=rows)
    w.resolve("l1", None)
    got0 = w.hot_view("l0")[where.long()][..., 0]
    got1 = w.hot_view("l1")[where.long()][..., 0]
    assert got0.tolist() == [[3, 9], [5, 1]] and got1.tolist() == [[103, 109], [105, 101]]
    assert (where[0] // 4).tolist() == [0, 0] and (where[1] // 4).tolist() == [1, 1]


def test_leader_resolving_twice_in_a_step_is_an_error():
    w = _worker()
    w.start_step(_meta(["a"], [0], [5]))
    top = torch.tensor([[1, 2]], dtype=torch.int32)
    w.resolve("l0", top)
    with pytest.raises(RuntimeError, match="already resolved this step"):
        w.resolve("l0", top)


def test_a_member_that_skipped_its_gather_is_detected_and_nothing_stale_survives():
    w = _worker()
    w.start_step(_meta(["a"], [0], [5]))
    w.resolve("l0", torch.tensor([[1, 2]], dtype=torch.int32))  # l1 never gathers
    with pytest.raises(RuntimeError, match="'l1' did not gather"):
        w.start_step(_meta(["a"], [0], [6]))
    assert bool((w.groups[0].slot_keys == -1).all())


def _ctx(layers):
    return SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=layers),
        model_config=SimpleNamespace(
            architectures=["LlamaForCausalLM"], hf_config=SimpleNamespace(index_topk=2)
        ),
    )


def test_stock_model_is_refused_with_one_line_naming_the_architecture():
    with pytest.raises(HiSparseModelError) as e:
        model_hisparse_layers(_ctx({"model.layers.0.self_attn.attn": object()}))
    msg = str(e.value)
    assert "\n" not in msg and "LlamaForCausalLM" in msg and "export-model" in msg
    assert model_hisparse_layers(_ctx({})) is None  # no model loaded: the caller drives the worker


def test_model_layers_give_groups_host_rows_and_a_pool_check():
    lay = lambda leader: SimpleNamespace(row_bytes=656, group_leader=leader)  # noqa: E731
    ctx = _ctx({"l0": lay("l0"), "l1": lay("l0"), "l2": lay("l2"), "idx": object()})
    cfg = HiSparseConfig(block_size=BS)
    layers = model_hisparse_layers(ctx)
    assert sorted(layers) == ["l0", "l1", "l2"]
    got = find_model_layers(ctx, SimpleNamespace(num_blocks=10), cfg, {}, layers)
    assert got.groups == [["l0", "l1"], ["l2"]] and got.host_rows == 40 and got.top_k == 2
    with pytest.raises(Exception, match=r"\['host_pool_gib'\].*--num-gpu-blocks-override"):
        find_model_layers(
            ctx,
            SimpleNamespace(num_blocks=10**7),
            HiSparseConfig(block_size=BS, host_pool_gib=0.001),
            {"host_pool_gib": 0.001},
            layers,
        )
    with pytest.raises(Exception, match=r"\['top_k'\] = 5 differs from the model's top-k"):
        find_model_layers(ctx, SimpleNamespace(num_blocks=10), cfg, {"top_k": 5}, layers)


def test_a_rewritten_position_is_never_served_from_its_stale_hot_copy():
    """Speculative rollback: the scheduler sees position 1 scheduled again and the worker drops
    the key's hot copy, so the next resolve misses and gathers the new bytes. Without the
    invalidation the old bytes would be a hit."""
    sched = _sched()
    w = HiSparseConnectorWorker(HiSparseConfig(top_k=2, hot_size=4, max_num_seqs=4, block_size=BS))
    w.register_kv_caches({"l0": torch.zeros(16, 16, dtype=torch.uint8)}, host_rows=40)
    host = w.host_view("l0")

    def step(out, value):
        meta = sched.build_connector_meta(out)
        w.start_step(meta)
        key = meta.anchors[0]
        w.save_kv_layer("l0", torch.full((1, 16), value, dtype=torch.uint8), [key])
        where = w.resolve(
            "l0",
            torch.tensor([[key - 1, key]], dtype=torch.int32),
            state_rows=w.batch_state_rows(torch.tensor([key])),
        )
        return w.hot_view("l0")[where.long()][0, :, 0].tolist()

    host[8] = 7  # position 0 of block 2
    assert step(_out({"a": 2}, new=[_new("a", 0, [2])]), 11) == [7, 11]
    assert step(_out({"a": 1}, cached=[("a", 2, None)]), 12)[1] == 12
    # rollback to position 2: it is written again with new bytes and must be read as such
    assert step(_out({"a": 1}, cached=[("a", 2, None)]), 99) == [11, 99]


def test_invalidate_keys_and_metadata_values_are_checked():
    s = _sched()
    s.build_connector_meta(_out({"a": 2}, new=[_new("a", 0, [2])]))
    for bad in (2**32 + 1, -5, 10**12):
        with pytest.raises(ValueError, match=r"keys\[0\] = .* lies outside the host pool"):
            s.impl.invalidate_keys("a", [bad])
    for bad in (1.5, True):
        with pytest.raises(ValueError, match=r"keys\[0\] must be an integer"):
            s.impl.invalidate_keys("a", [bad])
    s.impl.invalidate_keys("a", [3])
    w = _worker()
    with pytest.raises(ValueError, match=r"state row 7 is not in \[0, max_num_seqs = 2\)"):
        w.start_step(_meta(["a"], [7], [5]))
    with pytest.raises(ValueError, match="distinct"):
        w.start_step(_meta(["a", "b"], [1, 1], [5, 6]))
    from hisparse.connector.worker import HiSparseConnectorMetadata

    over = HiSparseConnectorMetadata(req_ids=("a",), state_rows=(0,), host_rows_in_use=41)
    with pytest.raises(ValueError, match=r"\['host_pool_gib'\]"):
        w.start_step(over)


def test_requests_sharing_an_anchor_get_distinct_rows_in_turn():
    """Two identical prompts fully served from vLLM's prefix cache both recompute their last
    token, in the same cached block slot, in one step: each batch row still gets its own row."""
    w = _worker()
    w.start_step(_meta(["a", "b"], [1, 0], [13, 13]))
    assert w.batch_state_rows(torch.tensor([13, 13])).tolist() == [1, 0]
    with pytest.raises(RuntimeError, match="no scheduled request's last token"):
        w.batch_state_rows(torch.tensor([13, 13, 13]))


def test_host_rows_in_use_count_shared_prefix_blocks_once():
    s = _sched()
    s.impl._scheduler.host_rows = 40
    m = s.build_connector_meta(
        _out({"a": 8, "b": 1}, new=[_new("a", 0, [3, 4]), _new("b", 7, [3, 4])])
    )
    assert m.host_rows_in_use == 2 * BS  # b's prompt is a's: both blocks are shared
    m = s.build_connector_meta(_out({"b": 1}, cached=[("b", 8, [9])]))
    assert m.host_rows_in_use == 3 * BS
    s.request_finished(SimpleNamespace(request_id="a"), [])
    m = s.build_connector_meta(_out({"b": 1}, cached=[("b", 9, None)]))
    assert m.host_rows_in_use == 3 * BS  # b still holds 3, 4 and 9
    s.request_finished(SimpleNamespace(request_id="b"), [])
    assert s.impl._scheduler.rows_in_use() == 0 and s.impl._scheduler.block_refs == {}
    assert s.get_kv_connector_stats().data["host_pool_usage"] == [0.0]


@pytest.mark.parametrize("bad", ["top_k=4", [("top_k", 4)]])
def test_non_mapping_extra_config_is_one_named_error(bad):
    from hisparse.connector.config import HiSparseConfigError

    with pytest.raises(HiSparseConfigError, match="kv_connector_extra_config must be a mapping"):
        connector_impl(bad, role="worker")
