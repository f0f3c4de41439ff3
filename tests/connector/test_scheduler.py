"""HiSparseScheduler without a worker (and without the facade): the step metadata it builds for new,
continuing, finished and preempted requests, what a release (``request_finished``) leaves for the
next step, anchors and rewritten keys from vLLM-shaped outputs, token counts against the pool, and
the errors, after which nothing has changed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hisparse.connector.config import HiSparseConfig
from hisparse.connector.metadata import HiSparseConnectorMetadata
from hisparse.connector.scheduler import HiSparseScheduler, StepSchedule
from tests.helpers import vllm_new_req, vllm_step

BS = 4


def _sched(S=3, host_rows=None):
    s = HiSparseScheduler(HiSparseConfig(top_k=2, hot_size=4, max_num_seqs=S, block_size=BS))
    if host_rows is not None:
        s.set_host_rows(host_rows)
    return s


def _fields(m: HiSparseConnectorMetadata) -> tuple:
    return m.req_ids, m.state_rows, m.reset_rows, m.invalidate, m.host_rows_in_use, m.anchors


def _state(s: HiSparseScheduler) -> tuple:
    return dict(s.tokens), s.rows.in_use, {r: s.rows.row_of(r) for r in s.tokens}


def test_new_requests_get_fresh_rows_in_batch_order_and_are_reset():
    s = _sched()
    m = s.build(StepSchedule({"b": 5, "a": 3}))
    assert isinstance(m, HiSparseConnectorMetadata)
    assert _fields(m) == (("b", "a"), (0, 1), (0, 1), (), 8, ())


def test_continuing_requests_keep_their_rows_and_unscheduled_ones_still_hold_tokens():
    s = _sched()
    s.build(StepSchedule({"a": 5, "b": 3}))
    # b alone: a keeps its row and its 5 tokens; nothing is reset again.
    assert _fields(s.build(StepSchedule({"b": 1}))) == (("b",), (1,), (), (), 9, ())
    # c is new (a and b hold rows 0 and 1); the batch order is the schedule's.
    assert _fields(s.build(StepSchedule({"c": 2, "a": 1}))) == (
        ("c", "a"),
        (2, 0),
        (2,),
        (),
        12,
        (),
    )
    assert s.tokens == {"a": 6, "b": 4, "c": 2}


def test_a_finished_requests_row_goes_to_a_new_request_in_the_same_step_reset_once():
    s = _sched(S=2)
    s.build(StepSchedule({"a": 5, "b": 3}))
    m = s.build(StepSchedule({"c": 2, "b": 1}, finished_req_ids={"a"}))
    # Both rows were taken: a's row is released and handed to c in the same step.
    assert _fields(m) == (("c", "b"), (0, 1), (0,), (), 2 + 4, ())
    assert "a" not in s.tokens and s.rows.row_of("a") is None and s.rows.in_use == 2


def test_a_preempted_request_gives_its_row_back_and_starts_over_when_resumed():
    s = _sched()
    s.build(StepSchedule({"a": 5, "b": 3}))
    m = s.build(StepSchedule({"a": 1}, preempted_req_ids={"b"}))
    assert _fields(m) == (("a",), (0,), (1,), (), 6, ())
    m = s.build(StepSchedule({"b": 4, "a": 1}))
    # b is a new request again: a reset row and its tokens counted from zero, not 3 + 4.
    assert _fields(m) == (("b", "a"), (1, 0), (1,), (), 4 + 7, ())


def test_release_resets_the_row_at_the_next_step_only_once():
    s = _sched()
    s.build(StepSchedule({"a": 5, "b": 3}))
    s.release("a")  # what request_finished does
    assert s.rows.row_of("a") is None and s.tokens == {"b": 3}
    s.release("a")  # a second release, and one of a request never seen, add nothing
    s.release("never-seen")
    # vLLM also lists the request as finished in the next output: still one reset.
    m = s.build(StepSchedule({"b": 1}, finished_req_ids={"a"}))
    assert _fields(m) == (("b",), (1,), (0,), (), 4, ())
    assert s.build(StepSchedule({"b": 1})).reset_rows == ()


def test_invalidated_keys_go_out_once_with_the_requests_row():
    s = _sched(host_rows=40)
    s.build(StepSchedule({"a": 2, "b": 2}))
    s.invalidate_keys("b", [7, torch.tensor(3)])
    s.invalidate_keys("a", (39,))
    m = s.build(StepSchedule({"a": 1}))
    assert m.invalidate == ((1, 7), (1, 3), (0, 39))
    assert s.build(StepSchedule({"a": 1})).invalidate == ()


def test_anchors_are_the_keys_of_each_requests_last_token_and_rewrites_are_invalidated():
    s = _sched()
    m = s.build(vllm_step({"a": 6}, new=[vllm_new_req("a", 0, [7, 2])]))
    # position 5: block 2 (the second), offset 1; two blocks held = 8 host rows
    assert _fields(m) == (("a",), (0,), (0,), (), 2 * BS, (2 * BS + 1,))
    # rolled back to position 4: positions 4 and 5 are written a second time
    m = s.build(vllm_step({"a": 2}, cached=[("a", 4, None)]))
    assert m.invalidate == ((0, 8), (0, 9)) and m.anchors == (9,) and m.reset_rows == ()
    # a grows into a new block 5: position 6 -> 2 * 4 + 2, position 8 -> 5 * 4 + 0
    m = s.build(vllm_step({"a": 3}, cached=[("a", 6, [5])]))
    assert m.anchors == (5 * BS,) and m.invalidate == () and m.host_rows_in_use == 3 * BS


def test_a_reused_row_is_reset_not_invalidated_for_the_keys_its_last_owner_wrote():
    s = _sched(S=1)
    s.build(vllm_step({"a": 6}, new=[vllm_new_req("a", 0, [2, 3])]))
    # b takes a's row and writes block 2 again (keys 8..11): the row is reset, which drops
    # every hot copy at once; b's own positions were never written, so none is invalidated.
    m = s.build(vllm_step({"b": 6}, new=[vllm_new_req("b", 0, [2, 5])], finished={"a"}))
    assert _fields(m) == (("b",), (0,), (0,), (), 2 * BS, (5 * BS + 1,))
    assert s.blocks == {"b": [2, 5]} and s.block_refs == {2: 1, 5: 1}


def test_anchors_are_sent_for_every_request_or_for_none():
    s = _sched()
    # x is scheduled but listed in neither new nor cached requests: no block list, no anchor.
    m = s.build(vllm_step({"a": 1, "x": 2}, new=[vllm_new_req("a", 0, [1])]))
    assert m.req_ids == ("a", "x") and m.anchors == ()


def test_host_rows_in_use_count_blocks_shared_by_a_prefix_once():
    s = _sched()
    m = s.build(
        vllm_step(
            {"a": 8, "b": 1}, new=[vllm_new_req("a", 0, [3, 4]), vllm_new_req("b", 7, [3, 4])]
        )
    )
    assert m.host_rows_in_use == 2 * BS and s.block_refs == {3: 2, 4: 2}
    s.release("a")
    assert s.rows_in_use() == 2 * BS and s.block_refs == {3: 1, 4: 1}
    s.release("b")
    assert s.rows_in_use() == 0 and s.block_refs == {}


def test_token_counts_past_the_pool_are_refused_and_change_nothing():
    s = _sched(host_rows=10)
    assert s.build(StepSchedule({"a": 6})).host_rows_in_use == 6
    before = _state(s)
    with pytest.raises(ValueError) as e:
        s.build(StepSchedule({"a": 3, "b": 2}))
    assert str(e.value) == (
        "live requests would hold 11 tokens but the host pool has 10 rows: raise "
        "kv_connector_extra_config['host_pool_gib'] or admit fewer requests"
    )
    assert _state(s) == before and s.rows.row_of("b") is None
    # Finished requests hold nothing: b fills the pool exactly once a is gone.
    m = s.build(StepSchedule({"b": 10}, finished_req_ids={"a"}))
    assert _fields(m) == (("b",), (0,), (0,), (), 10, ())  # a's row, reset


def test_running_out_of_rows_names_max_num_seqs_and_changes_nothing():
    s = _sched(S=2)
    s.build(StepSchedule({"a": 1, "b": 1}))
    before = _state(s)
    with pytest.raises(RuntimeError) as e:
        s.build(StepSchedule({"c": 1, "d": 1, "e": 1}, finished_req_ids={"a"}))
    assert str(e.value) == (
        "request 'e' needs a HiSparse state row but all "
        "kv_connector_extra_config['max_num_seqs'] = 2 are in use"
    )
    assert _state(s) == before and s.rows.row_of("a") == 0  # the finish was not committed
    m = s.build(StepSchedule({"c": 1}, finished_req_ids={"a"}))  # the retry sees the same rows
    assert _fields(m) == (("c",), (0,), (0,), (), 2, ())


@pytest.mark.parametrize(
    "bad, says",
    [
        (0, "must be >= 1, got 0"),
        (-100, "must be >= 1"),
        (1.5, "must be an integer"),
        (True, "must be an integer, got bool"),
    ],
)
def test_each_token_count_is_an_integer_of_at_least_one(bad, says):
    s = _sched()
    with pytest.raises(ValueError, match=rf"^num_scheduled_tokens\['a'\] {says}"):
        s.build(SimpleNamespace(num_scheduled_tokens={"b": 1, "a": bad}))
    assert s.tokens == {} and s.rows.in_use == 0
    with pytest.raises(ValueError, match="must be a dict"):
        s.build(SimpleNamespace(finished_req_ids=set()))
    m = s.build(SimpleNamespace(num_scheduled_tokens={"a": torch.tensor(3)}))
    assert m.host_rows_in_use == 3 and type(s.tokens["a"]) is int


def test_invalidate_keys_refuses_unknown_requests_and_keys_outside_the_pool():
    s = _sched()
    s.build(StepSchedule({"a": 1}))
    with pytest.raises(ValueError, match="request 'zzz' holds no HiSparse state row"):
        s.invalidate_keys("zzz", [1])
    with pytest.raises(ValueError, match="keys must be a sequence of host rows, got int"):
        s.invalidate_keys("a", 5)
    with pytest.raises(ValueError, match=r"keys\[1\] = 2147483647 .*\(int32 keys\)"):
        s.invalidate_keys("a", [1, 2**31 - 1])
    s.set_host_rows(10)
    with pytest.raises(ValueError, match=r"^keys\[0\] = 10 lies outside .* \[0, 10\) \(host_rows"):
        s.invalidate_keys("a", [10])
    assert s.pending_invalidate == []  # a refused call queues nothing, not even its good keys


@pytest.mark.parametrize(
    "bad, says",
    [
        (0, "must be >= 1"),
        (True, "must be an integer, got bool True"),
        (2**31, "must be <= 2147483647"),
    ],
)
def test_set_host_rows_takes_a_positive_int32(bad, says):
    with pytest.raises(ValueError, match=f"^host_rows {says}"):
        _sched().set_host_rows(bad)


def test_gauges_report_pool_usage_only_when_the_pool_is_known():
    s = _sched()
    s.build(StepSchedule({"a": 4}))
    assert s.gauges() is None
    s.set_host_rows(16)
    assert s.gauges().data["host_pool_usage"] == [0.25]
    s.release("a")
    g = s.gauges().data
    assert g["host_pool_usage"] == [0.0] and g["hot_rows_in_use"] == [0]
