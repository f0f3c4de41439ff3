"""Issue 23, items 1-6 on the connector: a skipped follower in several index groups, the last
silent acceptances of the scheduler and the step metadata (one integer rule everywhere), the pool
known to the scheduler without vLLM, and the reasons given for late resolves and huge slots."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hisparse.connector import StepSchedule
from hisparse.connector.config import HiSparseConfig
from hisparse.connector.metadata import HiSparseConnectorMetadata
from hisparse.connector.worker import HiSparseConnectorWorker
from tests.helpers import connector_impl

LAYERS = ("l0", "l1", "l2", "l3")


class IntScalar:
    """What numpy's int64 offers the connector (``__index__``, a dtype, ndim 0) without being an
    ``int``: numpy may be absent, and the rule must not depend on importing it."""

    ndim = 0
    dtype = "int64"

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v

    def __repr__(self) -> str:
        return f"IntScalar({self.v})"


def _two_group_worker(S=2, H=4, K=2):
    w = HiSparseConnectorWorker(HiSparseConfig(top_k=K, hot_size=H, max_num_seqs=S, block_size=4))
    w.register_kv_caches(
        {n: torch.zeros(S * H, 16, dtype=torch.uint8) for n in LAYERS},
        host_rows=40,
        groups=[["l0", "l1"], ["l2", "l3"]],
    )
    for i, n in enumerate(LAYERS):  # host row k of layer i holds 50 * i + k
        w.host_view(n)[:] = (50 * i + torch.arange(40, dtype=torch.uint8)).unsqueeze(1)
    return w


def _meta(rows=(0,), rids=("a",)):
    return HiSparseConnectorMetadata(req_ids=rids, state_rows=rows)


def _full_step(w, keys, meta):
    """A correct step: every layer resolves; the bytes each layer's attention reads."""
    w.start_step(meta)
    top = torch.tensor([keys], dtype=torch.int32)
    got = {}
    for n in LAYERS:
        where = w.resolve(n, top if n in ("l0", "l2") else None)
        got[n] = w.hot_view(n)[where.long()][0, :, 0].tolist()
    return got


def _expected(keys):
    return {n: [50 * i + k for k in keys] for i, n in enumerate(LAYERS)}


@pytest.mark.parametrize("then", ["retry", "next step"])
def test_skipped_followers_in_two_groups_are_all_reported_and_reset(then):
    w = _two_group_worker()
    w.start_step(_meta())
    top = torch.tensor([[1, 2]], dtype=torch.int32)
    w.resolve("l0", top)
    w.resolve("l2", top)  # neither l1 nor l3 gathers
    with pytest.raises(RuntimeError) as e:
        w.start_step(_meta())
    msg = str(e.value)
    assert "\n" not in msg and "'l1' did not gather" in msg and "'l3' did not gather" in msg
    assert all(bool((g.slot_keys == -1).all()) for g in w.groups)
    meta = _meta() if then == "retry" else _meta((1,), ("b",))
    # The same keys again: a group left holding them would serve l1/l3 rows never copied.
    assert _full_step(w, [1, 2], meta) == _expected([1, 2])
    assert _full_step(w, [2, 3], _meta((1,), ("b",))) == _expected([2, 3])


def test_resolve_after_clear_connector_metadata_names_the_ended_step():
    conn = connector_impl(
        {"top_k": 2, "hot_size": 4, "max_num_seqs": 2, "index_share": 2}, "worker"
    )
    conn.register_kv_caches({n: torch.zeros(8, 16, dtype=torch.uint8) for n in ("l0", "l1")})
    conn.bind_connector_metadata(_meta())
    conn.start_load_kv(None)
    top = torch.tensor([[1, 2]], dtype=torch.int32)
    conn.resolve("l0", top)
    conn.resolve("l1", None)
    conn.clear_connector_metadata()
    for layer, arg in (("l0", top), ("l1", None)):
        with pytest.raises(RuntimeError, match="after clear_connector_metadata") as e:
            conn.resolve(layer, arg)
        assert "already resolved" not in str(e.value) and "start_load_kv" in str(e.value)
    conn.bind_connector_metadata(_meta())
    conn.start_load_kv(None)
    conn.resolve("l0", top)  # a new step resolves again


@pytest.mark.parametrize(
    "count, fragment",
    [
        (-100, r"num_scheduled_tokens\['a'\] must be >= 1, got -100"),
        (0, r"num_scheduled_tokens\['a'\] must be >= 1, got 0"),
        (1.7, r"num_scheduled_tokens\['a'\] must be an integer, got float 1.7"),
        (True, r"num_scheduled_tokens\['a'\] must be an integer, got bool"),
        (torch.tensor(2.5), r"num_scheduled_tokens\['a'\] must be an integer, got Tensor"),
    ],
)
def test_step_schedule_refuses_negative_zero_and_fractional_counts(count, fragment):
    with pytest.raises(ValueError, match=fragment):
        StepSchedule({"a": count})
    sched = connector_impl({"top_k": 2}, "scheduler")
    vllm_shaped = SimpleNamespace(num_scheduled_tokens={"a": count}, finished_req_ids=set())
    with pytest.raises(ValueError, match=fragment):
        sched.build_connector_meta(vllm_shaped)
    assert sched._scheduler.tokens == {}  # nothing was committed


def test_integer_scalars_follow_one_rule_in_scheduler_metadata_and_runtime():
    sched = connector_impl({"top_k": 2, "max_num_seqs": 2}, "scheduler")
    meta = sched.build_connector_meta(StepSchedule({"a": IntScalar(3)}))
    assert meta.host_rows_in_use == 3 and type(meta.host_rows_in_use) is int
    sched.invalidate_keys("a", [IntScalar(5), torch.tensor(6)])
    meta = sched.build_connector_meta(StepSchedule({"a": 1}))
    row = meta.state_rows[0]
    assert meta.invalidate == ((row, 5), (row, 6))
    assert all(type(x) is int for pair in meta.invalidate for x in pair)
    refused = ((torch.tensor(1.5), "Tensor of torch.float32"), (True, "bool"), (1.0, "float"))
    for bad, what in refused:
        with pytest.raises(ValueError, match=rf"keys\[0\] must be an integer, got {what}"):
            sched.invalidate_keys("a", [bad])
    assert sched._scheduler.pending_invalidate == []  # tensor(1.5) did not invalidate key 1
    m = HiSparseConnectorMetadata(
        req_ids=("a",),
        state_rows=(IntScalar(1),),
        invalidate=((IntScalar(1), IntScalar(7)),),
        anchors=(IntScalar(9),),
        host_rows_in_use=IntScalar(4),
    )
    assert (m.state_rows, m.invalidate, m.anchors, m.host_rows_in_use) == ((1,), ((1, 7),), (9,), 4)
    w = _two_group_worker()
    w.start_step(m)  # the worker takes them like plain ints
    w.groups[0].invalidate_keys([IntScalar(0)], [IntScalar(3)])
    for field, value, fragment in (
        ("state_rows", (True,), r"state_rows\[0\] must be an integer, got bool"),
        ("state_rows", (0.5,), r"state_rows\[0\] must be an integer, got float"),
        ("host_rows_in_use", -3, r"host_rows_in_use must be >= 0, got -3"),
        ("anchors", (torch.tensor(2.0),), r"anchors\[0\] must be an integer"),
    ):
        fields = {"req_ids": ("a",), "state_rows": (0,), field: value}
        with pytest.raises(ValueError, match=fragment):
            HiSparseConnectorMetadata(**fields)
    with pytest.raises(ValueError, match=r"invalidate\[0\]\[1\] must be an integer"):
        HiSparseConnectorMetadata(invalidate=((0, 1.5),))


def test_real_numpy_integers_pass_where_plain_ints_do():
    np = pytest.importorskip("numpy")
    sched = connector_impl({"top_k": 2}, "scheduler")
    sched.build_connector_meta(StepSchedule({"a": np.int64(2)}))
    sched.invalidate_keys("a", [np.int64(1), np.int32(0)])
    with pytest.raises(ValueError, match="got bool"):
        sched.invalidate_keys("a", [np.bool_(True)])
    m = HiSparseConnectorMetadata(req_ids=("a",), state_rows=(np.int64(0),))
    assert type(m.state_rows[0]) is int


def test_the_scheduler_knows_the_pool_without_vllm_and_refuses_at_entry():
    extra = {"top_k": 2, "hot_size": 4, "max_num_seqs": 2, "block_size": 4}
    work = connector_impl(extra, "worker")
    work.worker.register_kv_caches({"l0": torch.zeros(8, 16, dtype=torch.uint8)}, host_rows=40)
    sched = connector_impl(extra, "scheduler", host_rows=work.worker.host_rows)
    sched.build_connector_meta(StepSchedule({"a": 30}))
    with pytest.raises(ValueError, match=r"keys\[0\] = 40 lies outside the host pool.*\[0, 40\)"):
        sched.invalidate_keys("a", [40])
    sched.invalidate_keys("a", [39])
    with pytest.raises(ValueError, match=r"would hold 41 tokens.*40 rows.*\['host_pool_gib'\]"):
        sched.build_connector_meta(StepSchedule({"a": 1, "b": 10}))
    assert sched._scheduler.tokens == {"a": 30}  # the refused step changed nothing
    with pytest.raises(ValueError, match="host_rows must be >= 1"):
        connector_impl(extra, "scheduler", host_rows=0)
    with pytest.raises(RuntimeError, match="scheduler-side"):
        connector_impl(extra, "worker", host_rows=40)


@pytest.mark.parametrize("store", ["hisparse", "hybrid"])
def test_the_dsa_engine_hands_its_pool_to_the_scheduler(store):
    """The engine's stores size the pool themselves (keys = block x max context + position) and
    tell their scheduler half, which then refuses what the pool cannot hold at entry; in HiSparse
    mode a request's block is the state row the connector gave it."""
    from hisparse.engine.dsa.hybrid import HybridRows
    from hisparse.engine.dsa.stores import HiSparseRows
    from hisparse.models.dsa.config import DSAConfig
    from hisparse.models.dsa.random_checkpoint import random_config

    cfg = DSAConfig.from_hf(random_config("glm_moe_dsa", num_hidden_layers=2))
    cpu = torch.device("cpu")
    if store == "hisparse":
        kv = HiSparseRows(cfg, 656, 64, cpu, 16, 2)
    else:
        kv = HybridRows(cfg, 656, 64, cpu, 16, 2, device_blocks=4)
    assert kv.sched._scheduler.host_rows == kv.worker.worker.host_rows == 2 * 64 + 16
    if store == "hisparse":  # one allocator: a request's block of keys is its state row
        blocks = kv.begin({"a": 5, "b": 3})
        rows = kv.sched._scheduler.rows
        assert blocks == [rows.row_of("a"), rows.row_of("b")] and len(set(blocks)) == 2
        kv.end()
    kv.close()


@pytest.mark.parametrize(
    "slot, fragment",
    [
        (2**40, r"slot 1099511627776, which is no valid key \(keys are int32"),
        (40, r"slot 40, outside the host pool's 40 rows: raise .*\['host_pool_gib'\]"),
    ],
)
def test_save_kv_layer_gives_the_reason_for_a_slot_past_the_pool(slot, fragment):
    w = _two_group_worker()
    with pytest.raises(ValueError, match=fragment) as e:
        w.save_kv_layer("l0", torch.zeros(1, 16, dtype=torch.uint8), torch.tensor([slot]))
    if slot > 2**31:
        assert "host_pool_gib" not in str(e.value)
