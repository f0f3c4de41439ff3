"""``decode_tokens`` (1 + num_speculative_tokens): the index groups resolve rows that wide, the
default hot buffer holds them, and a hot_size that cannot is refused in one line naming it;
under vLLM the value comes from the speculative config (stand-in configs, without vLLM). A
draft's later passes (two or more draft tokens) resolve their group again within the step, and
the positions they wrote are invalidated when the next step writes them again."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.connector.scheduler import HiSparseScheduler
from hisparse.connector.worker import HiSparseConnectorMetadata, HiSparseConnectorWorker
from hisparse.ops.limits import MAX_HOT_SIZE
from hisparse.vllm.settings import config_from_vllm
from tests.helpers import vllm_new_req, vllm_step


def test_the_default_hot_buffer_holds_a_speculative_decodes_keys():
    assert HiSparseConfig(top_k=2048).hot_size == 4096
    assert HiSparseConfig(top_k=2048, decode_tokens=2).hot_size == 4096
    c = HiSparseConfig(top_k=2048, decode_tokens=3)
    assert (c.resolve_width, c.hot_size) == (6144, 6144)


def test_a_hot_size_below_the_union_is_refused_naming_it():
    with pytest.raises(HiSparseConfigError) as e:
        HiSparseConfig(top_k=64, hot_size=100, decode_tokens=2)
    msg = str(e.value)
    assert msg.startswith("kv_connector_extra_config['hot_size'] = 100") and "128" in msg
    assert "\n" not in msg
    with pytest.raises(HiSparseConfigError, match="num_speculative_tokens"):
        HiSparseConfig(top_k=MAX_HOT_SIZE // 2, decode_tokens=3)
    for bad in (0, True, 1.5):
        with pytest.raises(HiSparseConfigError, match="decode_tokens"):
            HiSparseConfig(decode_tokens=bad)


def test_the_index_groups_resolve_rows_of_every_query_token():
    cfg = HiSparseConfig(top_k=8, decode_tokens=2, max_num_seqs=2, block_size=4)
    w = HiSparseConnectorWorker(cfg)
    w.register_kv_caches({"l": torch.zeros(2 * cfg.hot_size, 32, dtype=torch.uint8)}, host_rows=16)
    assert [g.top_k for g in w.groups] == [16]


def _vllm(spec=None, hf=None, extra=None):
    kv = NS(kv_connector_module_path="hisparse.vllm.connector", kv_connector_extra_config=extra)
    return NS(
        model_config=NS(hf_config=hf or NS(index_topk=64)),
        speculative_config=spec,
        scheduler_config=NS(max_num_seqs=4),
        cache_config=NS(block_size=16),
        kv_transfer_config=kv,
    )


def test_vllm_speculation_sets_the_decode_tokens():
    assert config_from_vllm(_vllm()).decode_tokens == 1
    cfg = config_from_vllm(_vllm(NS(num_speculative_tokens=1)))
    assert (cfg.top_k, cfg.decode_tokens, cfg.hot_size) == (64, 2, 128)
    assert config_from_vllm(_vllm(NS(num_speculative_tokens=3))).hot_size == 256
    with pytest.raises(HiSparseConfigError, match=r"\['decode_tokens'\] = 1 differs"):
        config_from_vllm(_vllm(NS(num_speculative_tokens=1), extra={"decode_tokens": 1}))
    with pytest.raises(HiSparseConfigError, match=r"\['hot_size'\] = 100 cannot hold"):
        config_from_vllm(_vllm(NS(num_speculative_tokens=1), extra={"hot_size": 100}))


def _two_layer_worker() -> HiSparseConnectorWorker:
    cfg = HiSparseConfig(top_k=4, decode_tokens=2, max_num_seqs=2, block_size=4, index_share=2)
    w = HiSparseConnectorWorker(cfg)
    bufs = {n: torch.zeros(2 * cfg.hot_size, 32, dtype=torch.uint8) for n in ("l0", "l1")}
    w.register_kv_caches(bufs, host_rows=16)
    for i, n in enumerate(bufs):
        w.save_kv_layer(n, torch.arange(16 * 32).view(16, 32).to(torch.uint8) + i, torch.arange(16))
    w.start_step(HiSparseConnectorMetadata(req_ids=("a",), state_rows=(1,)))
    return w


def test_a_drafts_later_pass_resolves_its_group_again_within_the_step():
    w = _two_layer_worker()
    top = torch.tensor([[1, 2, 3, 4, 2, 3, 4, 5]], dtype=torch.int32)
    w.resolve("l0", top)
    w.resolve("l1", None)
    with pytest.raises(RuntimeError, match="already resolved this step"):
        w.resolve("l0", top)
    w.next_pass()
    with pytest.raises(RuntimeError, match="'l1' follows 'l0', which has not resolved"):
        w.resolve("l1", None)
    again = w.resolve("l0", top)
    w.resolve("l1", None)
    # 5 distinct keys copied in once; the second pass finds every one of them hot.
    assert w.groups[0].stats.tolist() == [5, 5]
    rows = again[0, again[0] >= 0].long()
    assert torch.equal(w.hot_view("l1")[rows], w.host_view("l1")[top[0, top[0] >= 0].long()])


def test_a_next_pass_with_an_ungathered_member_is_refused():
    w = _two_layer_worker()
    w.resolve("l0", torch.tensor([[1, 2, 3, 4, -1, -1, -1, -1]], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="'l1' did not gather"):
        w.next_pass()


def test_a_new_plan_in_the_next_pass_drops_the_deferred_one():
    """A draft's later pass that gathers must not hand the row read the last pass's plan."""
    w = HiSparseConnectorWorker(HiSparseConfig(top_k=2, hot_size=4, max_num_seqs=3, block_size=4))
    names = ("l0", "l1")
    w.register_kv_caches(
        {n: torch.zeros(12, 16, dtype=torch.uint8) for n in names},
        host_rows=40,
        groups=[["l0"], ["l1"]],
    )
    w.start_step(HiSparseConnectorMetadata(req_ids=("a", "b", "c"), state_rows=(0, 1, 2)))
    top = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    for n in names:
        w.resolve(n, top, defer_misses=True)
    assert w.miss_plan("l0") is not None
    w.next_pass()
    w.resolve("l0", top)  # gathered this time
    assert w.miss_plan("l0") is None and w.miss_plan("l1") is not None


def test_positions_a_drafts_later_passes_wrote_are_invalidated_when_written_again():
    def sched(q):
        s = HiSparseScheduler(
            HiSparseConfig(top_k=2, decode_tokens=q, max_num_seqs=2, block_size=4)
        )
        s.build(vllm_step({"a": 6}, new=[vllm_new_req("a", 0, [7, 2])]))
        # all drafts accepted: positions 6..8 scheduled (position 8 in the new block 5)
        return s.build(vllm_step({"a": 3}, cached=[("a", 6, [5])]))

    assert sched(2).invalidate == ()
    # with two draft tokens the draft's second pass wrote position 6 (block 2, offset 2)
    assert sched(3).invalidate == ((0, 2 * 4 + 2),)
