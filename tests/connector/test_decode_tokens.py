"""``decode_tokens`` (1 + num_speculative_tokens): the index groups resolve rows that wide, the
default hot buffer holds them, and a hot_size that cannot is refused in one line naming it;
under vLLM the value comes from the speculative config (stand-in configs, without vLLM)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
import torch

from hisparse.connector.config import HiSparseConfig, HiSparseConfigError
from hisparse.connector.worker import HiSparseConnectorWorker
from hisparse.ops.limits import MAX_HOT_SIZE
from hisparse.vllm.settings import config_from_vllm


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
    # The exported reference model resolves one-token decodes only.
    ref = NS(hisparse={"top_k": 64})
    assert config_from_vllm(_vllm(NS(num_speculative_tokens=1), ref)).decode_tokens == 1
    with pytest.raises(HiSparseConfigError, match=r"\['decode_tokens'\] = 1 differs"):
        config_from_vllm(_vllm(NS(num_speculative_tokens=1), extra={"decode_tokens": 1}))
    with pytest.raises(HiSparseConfigError, match=r"\['hot_size'\] = 100 cannot hold"):
        config_from_vllm(_vllm(NS(num_speculative_tokens=1), extra={"hot_size": 100}))
