"""Hybrid residency in the DSA engine (``generate(..., mode="hybrid", device_blocks=N)``) on the
CPU: with a device budget that forces spills mid-generation, spilled admissions and returns,
the tokens are bit-identical to resident for both architectures in f32 and fp8 rows; a spill
or a return that skips a layer's rows changes them (the test sees what the moves copy); the
policy's choices, the budget's one-line errors and ``demo --model DIR --device-blocks N``."""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.dsa.budget import DeviceKV
from hisparse.engine.dsa.generate import byte_prompts, generate
from hisparse.engine.dsa.hybrid import HybridRows
from hisparse.engine.dsa.residency import Residency
from hisparse.engine.dsa.stores import BLOCK
from hisparse.models.dsa.random_checkpoint import write_random_checkpoint
from hisparse.models.dsa.weights import CheckpointError, load_checkpoint
from hisparse.models.rows import ROW_FORMATS
from hisparse.ops.limits import default_hot_size
from tests.engine.dsa.helpers import ARCHS, one_thread

CPU = torch.device("cpu")
# Five requests through a batch of three, 40 tokens each, under 12 device blocks of 16 rows
# (all would need 26): some are admitted spilled, one is spilled while it decodes, spilled
# ones come back when others finish.
PROMPTS, NEW, BATCH, BUDGET = 5, 40, 3, 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa_hybrid")
    return {a: load_checkpoint(write_random_checkpoint(root / a, a, seed=3), CPU) for a in ARCHS}


def _run(ck, mode: str, row_format: str = "f32", **kw):
    with one_thread():
        prompts = byte_prompts(ck, PROMPTS)
        return generate(ck, mode, row_format, CPU, prompts, NEW, max_batch=BATCH, **kw)


@pytest.mark.parametrize("row_format", ["f32", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_hybrid_tokens_are_bit_identical_to_resident(checkpoints, arch, row_format):
    ck = checkpoints[arch]
    res = _run(ck, "resident", row_format)
    hy = _run(ck, "hybrid", row_format, device_blocks=BUDGET)
    c = hy.counters
    assert hy.spills >= 1 and c["spills"] == hy.spills, c  # spilled while decoding
    assert c["spilled_requests"] > hy.spills, c  # and admitted spilled
    assert c["returns"] >= 1 and c["peak_spilled"] >= 1, c
    assert c["spilled_rows"] > 0 and c["returned_rows"] > 0, c
    assert c["misses"] > 0 and c["hits"] > 0, c  # spilled requests decoded from hot buffers
    assert hy.tokens == res.tokens, f"{arch} {row_format}: {c}"
    assert len(set(res.tokens[0])) > 3, res.tokens[0]


def test_a_budget_that_holds_everything_never_spills(checkpoints):
    ck = checkpoints["deepseek_v32"]
    hy = _run(ck, "hybrid", device_blocks=64)
    assert hy.spills == 0 and hy.counters["spilled_requests"] == 0, hy.counters
    assert "hits" not in hy.counters  # the connector never ran a step
    assert hy.tokens == _run(ck, "resident").tokens


def test_a_budget_of_one_block_spills_every_request_and_keeps_the_tokens(checkpoints):
    # every step is all spilled: rows go to the host pool by their keys, no plan
    ck = checkpoints["glm_moe_dsa"]
    hy = _run(ck, "hybrid", device_blocks=1)
    c = hy.counters
    assert c["spilled_requests"] == PROMPTS and c["spills"] == c["returns"] == 0, c
    assert hy.tokens == _run(ck, "resident").tokens


@pytest.mark.parametrize("move", ["_write_spill", "_read_back"])
def test_a_spill_or_return_that_skips_a_layer_changes_the_tokens(checkpoints, monkeypatch, move):
    """Negative controls: a spilled request reads back exactly what the spill wrote to the host
    pool (``_write_spill``), a returned one exactly what its return copied into its device
    pages (``_read_back``); either move skipping layer 1 changes the tokens."""
    real = getattr(HybridRows, move)

    def lossy(self, layer, *args):
        if layer != 1:
            real(self, layer, *args)

    ck = checkpoints["glm_moe_dsa"]
    res = _run(ck, "resident")
    monkeypatch.setattr(HybridRows, move, lossy)
    hy = _run(ck, "hybrid", device_blocks=BUDGET)
    assert hy.spills >= 1 and hy.counters["returns"] >= 1
    assert hy.tokens != res.tokens


@pytest.mark.parametrize("bad", [0, -3, 2.5, "12", True, None])
def test_a_bad_budget_is_refused_in_one_line_naming_it(checkpoints, bad):
    with pytest.raises(CheckpointError) as e:
        _run(checkpoints["deepseek_v32"], "hybrid", device_blocks=bad)
    msg = str(e.value)
    assert "device_blocks" in msg and "\n" not in msg, msg


def test_a_budget_outside_hybrid_or_a_bad_hot_slots_is_refused(checkpoints):
    ck = checkpoints["deepseek_v32"]
    with pytest.raises(CheckpointError, match="device_blocks and hot_slots apply to mode 'hybrid'"):
        _run(ck, "resident", device_blocks=8)
    with pytest.raises(CheckpointError, match="device_blocks and hot_slots apply to mode 'hybrid'"):
        _run(ck, "hisparse", hot_slots=2)
    for bad in (0, 1.5, True):
        with pytest.raises(CheckpointError, match="hot_slots must be an integer >= 1"):
            _run(ck, "hybrid", device_blocks=8, hot_slots=bad)


def test_with_few_hot_buffers_requests_wait_and_tokens_stay_equal(checkpoints):
    """One hot buffer: at most one request is spilled at once; a request that fits neither the
    pages nor the hot buffer waits for one, and every token still equals resident's. The
    row buffer is the pages and that one hot buffer."""
    ck = checkpoints["glm_moe_dsa"]
    hy = _run(ck, "hybrid", device_blocks=14, hot_slots=1)
    c = hy.counters
    assert c["peak_spilled"] == 1 and c["spills"] >= 1 and c["returns"] >= 1, c
    assert hy.tokens == _run(ck, "resident").tokens
    admitted = [i for i, (_, prefill) in enumerate(hy.steps) if prefill]
    unbounded = [i for i, (_, prefill) in enumerate(_run(ck, "hybrid", device_blocks=14).steps)
                 if prefill]  # fmt: skip
    assert admitted[-1] > unbounded[-1], (admitted, unbounded)  # the last request waited
    rows = hy.device_bytes["rows"] // (ck.cfg.num_layers * ROW_FORMATS["f32"].row_bytes)
    assert rows == 14 * BLOCK + default_hot_size(ck.cfg.index_topk), rows


def test_residency_spill_cap():
    r = Residency(num_pages=4, block=16, max_spilled=1)
    assert r.admit(0, 32)  # 2 pages leave 2 free, >= one per resident request (itself) + 1
    assert r.can_admit(16) and not r.admit(1, 16)  # 1 page would leave 1 < 2: spilled
    assert not r.can_admit(16)  # no pages to spare and the one hot buffer taken: it waits
    with pytest.raises(RuntimeError, match="ask can_admit first"):
        r.admit(2, 16)
    assert r.grow(0, 64) == [] and not r.free  # the two free pages
    with pytest.raises(RuntimeError, match="raise device_blocks or hot_slots"):
        r.grow(0, 65)  # a page only a spill could give, and no hot buffer for it
    r.release(1)
    assert r.can_admit(16)


def test_residency_policy():
    r = Residency(num_pages=8, block=16)
    assert r.admit(0, 40)  # 3 pages leave 5 free, >= one per resident request (itself) + 1
    assert r.admit(1, 33)  # 3 pages leave 2 free, >= 1 + 1
    assert len(r.free) == 2
    assert not r.admit(2, 16)  # 1 page would leave 1 < 2 + 1: admitted spilled
    assert r.spill_order == [2]
    assert r.grow(0, 49) == [] and len(r.pages[0]) == 4  # a free page
    assert r.grow(1, 49) == [] and not r.free
    # no page free: the latest-admitted resident request (1) is spilled, its pages freed
    spilled = r.grow(0, 65)
    assert [s for s, _ in spilled] == [1] and len(r.pages[0]) == 5
    assert r.spill_order == [2, 1] and not r.resident(1)
    # the latest admitted is the grower itself: it spills, nothing else moves
    r2 = Residency(num_pages=2, block=16)
    assert r2.admit(0, 16)
    assert [s for s, _ in r2.grow(0, 17)] == []
    assert [s for s, _ in r2.grow(0, 33)] == [0] and not r2.resident(0)
    # returns: oldest spill first, one page more than held, headroom kept, not the skipped
    r.release(0)
    assert r.returns({1: 49, 2: 16}, skip={2}) == [1] and len(r.pages[1]) == 4
    assert r.returns({2: 16}, skip=()) == [2]


def test_a_budget_split_spends_the_fewest_hot_buffers_that_hold_the_rest():
    kv = DeviceKV(layers=2, full_layers=1, row_bytes=100, key_bytes=10, context=64, hot_size=32)
    pages = kv.context // BLOCK
    c = 6
    low, high = kv.total("hybrid", c, 1, c), kv.total("resident", c)  # all spilled; all resident
    for budget in (high + 3 * kv.block_bytes, (high + low) // 2, low):
        blocks, hot = kv.hybrid_split(c, budget)
        assert kv.total("hybrid", c, blocks, hot) <= budget
        assert blocks >= max(1, (c - hot) * (pages + 1)), (blocks, hot)
        if hot > 1:  # one hot buffer fewer leaves too few blocks for the rest
            fewer = (budget - kv.total("hybrid", c, 0, hot - 1)) // kv.block_bytes
            assert fewer < (c - hot + 1) * (pages + 1)
    assert kv.hybrid_split(c, kv.total("resident", c) + 3 * kv.block_bytes)[1] == 1
    assert kv.hybrid_split(c, kv.total("hybrid", c, 1, c)) == (1, c)
    assert kv.hybrid_split(c, kv.total("hybrid", c, 1, c) - 1) == (0, c)
