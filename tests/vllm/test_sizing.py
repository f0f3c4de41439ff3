"""HiSparse mode's KV sizing under vLLM (``hisparse.vllm.sizing.plan``), on stand-ins for vLLM's
config and KV specs of the DeepSeek-V3.2 / GLM-5 classes: the hot buffers are charged to the
device budget, the blocks are capped by the host pool (a share of the available RAM, or
host_pool_gib), and each refusal is one line."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.models.rows import ROW_FORMATS
from hisparse.vllm import sizing
from hisparse.vllm.sizing import HiSparseSizingError, plan, refuse_early, token_row_bytes

GIB = 1 << 30


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


def _per_block(specs) -> int:
    return sum(s.page_size_bytes for s in specs[0].values())


#: Bytes of one token's rows: 4 layers of f32 rows (``_dsa_config``'s defaults).
ROWS = 4 * ROW_FORMATS["f32"].row_bytes
#: max_num_seqs x hot_size (2 x index_topk 16) x ROWS: the hot buffers charged to the budget.
HOT = 128 * 32 * ROWS


@pytest.mark.parametrize("arch", list(DSA_CLASSES))
def test_the_host_pool_caps_the_blocks_within_one_device_budget(arch):
    """The GLM-5 start-up of the issue: --gpu-memory-utilization 0.5 of a 23 GiB machine gave the
    indexer caches alone ~11 GiB, a 46 GiB pool; now the pool is capped by the RAM left, and the
    blocks plus the hot buffers stay inside the one device budget."""
    vc, specs = _dsa_config(arch), _dsa_specs(arch)
    budget = int(11.3 * GIB)
    p = plan(vc, specs, [budget], device_is_host=True, ram_available=22 * GIB)
    assert p.hot_bytes == HOT
    assert p.pool_cap_bytes == int(0.5 * (22 * GIB - budget))
    assert p.host_pool_bytes == p.blocks * 16 * ROWS <= p.pool_cap_bytes
    assert p.limited_by == "host pool" and p.pools == 1
    assert p.available_memory == [p.blocks * _per_block(specs)]
    assert p.blocks * _per_block(specs) + p.hot_bytes <= budget  # one budget for both
    line = p.line()
    assert "\n" not in line and line.startswith(f"HiSparse sizing: {p.blocks} KV blocks")
    assert "host_pool_fraction" in line


def test_a_small_budget_limits_the_blocks_with_hot_buffers_charged():
    vc, specs = _dsa_config("glm_moe_dsa"), _dsa_specs("glm_moe_dsa")
    budget = HOT + 100 * _per_block(specs) + 7
    p = plan(vc, specs, [budget], device_is_host=True, ram_available=64 * GIB)
    assert p.limited_by == "device budget" and p.blocks == 100 and p.hot_bytes == HOT


def test_host_pool_gib_is_the_cap_when_given():
    vc = _dsa_config("deepseek_v32", {"host_pool_gib": 0.5})
    p = plan(vc, _dsa_specs("deepseek_v32"), [GIB], device_is_host=True, ram_available=64 * GIB)
    assert p.pool_cap_bytes == GIB // 2 and p.host_pool_bytes <= GIB // 2
    assert "host_pool_gib" in p.line()


def test_host_pool_fraction_changes_the_cap():
    vc = _dsa_config("deepseek_v32", {"host_pool_fraction": 0.25})
    p = plan(vc, _dsa_specs("deepseek_v32"), [GIB], device_is_host=False, ram_available=16 * GIB)
    assert p.pool_cap_bytes == 4 * GIB


def test_hot_buffers_past_the_budget_are_refused_with_one_line():
    vc = _dsa_config("glm_moe_dsa")
    with pytest.raises(HiSparseSizingError, match="lower --max-num-seqs") as e:
        plan(vc, _dsa_specs("glm_moe_dsa"), [HOT], device_is_host=True, ram_available=64 * GIB)
    assert "\n" not in str(e.value)


def test_a_pool_cap_below_one_request_is_refused_with_one_line():
    vc = _dsa_config("glm_moe_dsa", {"host_pool_gib": 0.001})
    with pytest.raises(HiSparseSizingError, match="raise the cap or lower --max-model-len") as e:
        plan(vc, _dsa_specs("glm_moe_dsa"), [GIB], device_is_host=True, ram_available=64 * GIB)
    assert "\n" not in str(e.value)


def test_dsa_without_our_connector_or_class_or_with_an_override_keeps_vllms_sizing():
    vc = _dsa_config("glm_moe_dsa")
    vc.model_config.architectures = ["GlmMoeDsaForCausalLM"]  # vLLM's own class
    assert plan(vc, _dsa_specs("glm_moe_dsa"), [GIB], device_is_host=True) is None
    vc = _dsa_config("glm_moe_dsa")
    vc.kv_transfer_config = None
    assert plan(vc, _dsa_specs("glm_moe_dsa"), [GIB], device_is_host=True) is None
    vc = _dsa_config("glm_moe_dsa")
    vc.kv_transfer_config.kv_connector_module_path = "other.connector"
    assert plan(vc, _dsa_specs("glm_moe_dsa"), [GIB], device_is_host=True) is None
    vc = _dsa_config("glm_moe_dsa")
    vc.cache_config.num_gpu_blocks_override = 400  # the RAM backs it: vLLM sizes with it
    specs = _dsa_specs("glm_moe_dsa")
    assert plan(vc, specs, [GIB], device_is_host=True, ram_available=16 * GIB) is None


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
