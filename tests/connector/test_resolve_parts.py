"""The connector's resolve in parts (``start=``): a leader resolves its batch part by part, each
part's misses gathered as it resolves; the step leaves what one resolve leaves, and a part out of
order, or one after misses left to the row read, is refused by name."""

from __future__ import annotations

import pytest
import torch

from hisparse.connector.config import HiSparseConfig
from hisparse.connector.metadata import HiSparseConnectorMetadata
from hisparse.connector.worker import HiSparseConnectorWorker

LAYERS = ("l0", "l1")  # one index group: l1 follows l0's plan
S, H, K = 3, 4, 2


def _worker(groups=(LAYERS,)):
    """Two layers; in one group (l1 gathers l0's plan, host rows interleaved) by default."""
    w = HiSparseConnectorWorker(HiSparseConfig(top_k=K, hot_size=H, max_num_seqs=S, block_size=4))
    w.register_kv_caches(
        {n: torch.zeros(S * H, 16, dtype=torch.uint8) for n in LAYERS},
        host_rows=40,
        groups=[list(g) for g in groups],
    )
    for i, n in enumerate(LAYERS):  # host row k of layer i holds 50 * i + k
        w.host_view(n)[:] = (50 * i + torch.arange(40, dtype=torch.uint8)).unsqueeze(1)
    return w


META = HiSparseConnectorMetadata(req_ids=("a", "b", "c"), state_rows=(0, 1, 2))
STEPS = ([[1, 2], [3, 4], [5, 6]], [[2, 7], [3, 4], [8, 9]], [[1, 9], [10, 4], [5, 6]])


def _step(w, keys, cuts):
    """One step, the leader resolving the rows between ``cuts``; what each layer reads."""
    w.start_step(META)
    top = torch.tensor(keys, dtype=torch.int32)
    for a, b in zip(cuts, cuts[1:]):
        where = w.resolve("l0", top[a:b], start=a)
        assert where.shape == (b, K), "every row resolved so far"
    got = {"l0": w.hot_view("l0")[where.long()][..., 0]}
    got["l1"] = w.hot_view("l1")[w.resolve("l1", None).long()][..., 0]
    return got


@pytest.mark.parametrize("cuts", [(0, 1, 3), (0, 1, 2, 3), (0, 2, 3)])
def test_a_batch_resolved_in_parts_reads_what_one_resolve_reads(cuts):
    one, parts = _worker(), _worker()
    for keys in STEPS:
        want = _step(one, keys, (0, 3))
        got = _step(parts, keys, cuts)
        for i, n in enumerate(LAYERS):
            assert torch.equal(got[n], want[n])
            assert got[n].tolist() == [[50 * i + k for k in row] for row in keys]
    for g1, g2 in zip(one.groups, parts.groups):
        assert g1.counters.tolist() == g2.counters.tolist()
        assert torch.equal(g1.slot_keys, g2.slot_keys) and torch.equal(g1.lru, g2.lru)


def test_a_part_out_of_order_or_after_deferred_misses_is_refused_by_name():
    w = _worker()
    w.start_step(META)
    top = torch.tensor(STEPS[0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"start=1: the next part of layer 'l0'.* so far \(0\)"):
        w.resolve("l0", top[1:], start=1)
    w.resolve("l0", top[:1])
    with pytest.raises(ValueError, match=r"start=2: .* so far \(1\)"):
        w.resolve("l0", top[2:], start=2)
    with pytest.raises(ValueError, match="defer_misses: the row read takes the step's misses"):
        w.resolve("l0", top[1:], start=1, defer_misses=True)
    with pytest.raises(ValueError, match="more than max_num_seqs = 3"):
        w.resolve("l0", top, start=1)
    w.resolve("l0", top[1:], start=1)  # the refusals changed nothing
    w.resolve("l1", None)
    w.start_step(META)  # every member gathered every part: the step closes cleanly
    w = _worker(groups=(["l0"], ["l1"]))  # rows a layer's own: the read can fetch them
    w.start_step(META)
    w.resolve("l0", top, defer_misses=True)
    assert w.miss_plan("l0") is not None
    with pytest.raises(ValueError, match="defer_misses: the row read takes the step's misses"):
        w.resolve("l0", top[:0], start=3)


def test_a_member_that_missed_the_last_part_is_named_at_the_next_step():
    w = _worker()
    w.start_step(META)
    top = torch.tensor(STEPS[0], dtype=torch.int32)
    w.resolve("l0", top[:2])
    w.resolve("l1", None)  # l1 gathers the first part only
    w.resolve("l0", top[2:], start=2)
    with pytest.raises(RuntimeError, match="'l1' did not gather"):
        w.start_step(META)


def test_a_new_plan_in_the_next_pass_drops_the_deferred_one():
    w = _worker(groups=(["l0"], ["l1"]))
    w.start_step(META)
    top = torch.tensor(STEPS[0], dtype=torch.int32)
    for n in LAYERS:
        w.resolve(n, top, defer_misses=True)
    assert w.miss_plan("l0") is not None
    w.next_pass()
    w.resolve("l0", top)  # gathered this time: the read must not be handed the old plan
    assert w.miss_plan("l0") is None and w.miss_plan("l1") is not None
