"""hisparse.models.dsa's config reader and sparse-attention math on the CPU, without
transformers: both config spellings, index groups, one-line errors, absorbed MLA over latent
rows against the expanded form, the indexer's scores against a per-head loop, causal top-k,
and the exact float32 row format."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.dsa import attention as mla
from hisparse.models.dsa import indexer as dsa_index
from hisparse.models.dsa.config import DSAConfig, DSAConfigError
from hisparse.models.rows import KV_DIM, ROW_FORMATS, decode_rows, encode_rows

BASE = {
    "model_type": "deepseek_v32",
    "num_hidden_layers": 4,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "q_lora_rank": 24,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "index_topk": 4,
    "index_n_heads": 3,
    "index_head_dim": 64,
}
YARN = {
    "rope_type": "yarn",
    "rope_theta": 1e4,
    "factor": 40.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}


def test_both_rope_spellings_give_the_same_config_and_yarn_scale():
    new = DSAConfig.from_hf({**BASE, "rope_parameters": YARN})
    old = DSAConfig.from_hf({**BASE, "rope_scaling": {**YARN, "type": "yarn"}, "rope_theta": 1e4})
    assert new.softmax_scale == pytest.approx(old.softmax_scale)
    mscale = 0.1 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert new.softmax_scale == pytest.approx(72**-0.5 * mscale**2)
    assert DSAConfig.from_hf(BASE).softmax_scale == pytest.approx(72**-0.5)


@pytest.mark.parametrize(
    "fields, types",
    [
        ({"indexer_types": ["full", "shared", "shared", "full"]}, "FSSF"),
        ({"index_topk_pattern": "FSFS"}, "FSFS"),
        ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, "FSFS"),
        ({}, "FFFF"),
    ],
)
def test_glm_index_groups_from_every_spelling(fields, types):
    cfg = DSAConfig.from_hf({**BASE, "model_type": "glm_moe_dsa", **fields})
    assert "".join(t[0].upper() for t in cfg.indexer_types) == types
    leaders = [cfg.leader(i) for i in range(4)]
    assert leaders == [max(j for j in range(i + 1) if types[j] == "F") for i in range(4)]
    assert cfg.indexer_rope_interleave  # GLM-5's indexer rotates interleaved pairs


def test_deepseek_runs_every_indexer_and_half_split_rope():
    cfg = DSAConfig.from_hf({**BASE, "index_topk_freq": 2})
    assert cfg.indexer_types == ("full",) * 4 and not cfg.indexer_rope_interleave


@pytest.mark.parametrize(
    "over, field",
    [
        ({"kv_lora_rank": 96, "hisparse_row_format": "fp8"}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 33}, "qk_rope_head_dim"),
        ({"qk_rope_head_dim": 96}, "index_head_dim"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"hisparse_row_format": "int4"}, "hisparse_row_format"),
        ({"model_type": "llama"}, "model_type"),
        ({"index_topk": None}, "index_topk"),
        ({"model_type": "glm_moe_dsa", "indexer_types": ["shared"] * 4}, "indexer_types"),
    ],
)
def test_config_errors_name_the_field_in_one_line(over, field):
    with pytest.raises(DSAConfigError) as e:
        DSAConfig.from_hf({**BASE, **over})
    assert field in str(e.value) and "\n" not in str(e.value)


def test_row_format_defaults_to_the_unquantized_row_of_the_dtype():
    cfg = DSAConfig.from_hf(BASE)
    assert (cfg.row_format_for("float32"), cfg.row_format_for("bfloat16")) == ("f32", "bf16")
    assert (
        DSAConfig.from_hf({**BASE, "hisparse_row_format": "fp8"}).row_format_for("float32") == "fp8"
    )


@pytest.mark.parametrize(
    "over, cache_dtype, want",
    [
        ({}, "fp8", "fp8"),  # vLLM's FP8 KV cache: the 656-B row
        ({}, "fp8_ds_mla", "fp8"),
        ({}, "bfloat16", "bf16"),
        ({"hisparse_row_format": "fp8"}, "fp8_e4m3", "fp8"),
        ({"hisparse_row_format": "f32"}, "auto", "f32"),
        ({}, "fp8_e5m2", "--kv-cache-dtype fp8_e5m2 has no latent row format"),
        ({"hisparse_row_format": "f32"}, "fp8", "hisparse_row_format is 'f32': drop one"),
        ({"kv_lora_rank": 96}, "fp8", "--kv-cache-dtype fp8: fp8 rows need kv_lora_rank"),
    ],
)
def test_vllms_kv_cache_dtype_picks_the_row_format_or_is_refused(over, cache_dtype, want):
    cfg = DSAConfig.from_hf({**BASE, **over})
    if " " not in want:
        assert cfg.row_format_for("float32", cache_dtype) == want
        return
    with pytest.raises(DSAConfigError) as e:
        cfg.row_format_for("float32", cache_dtype)
    assert want in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("latent, rope", [(512, 64), (42, 8)])
def test_absorbed_attention_over_rows_equals_expanded_mla(latent, rope):
    cfg = DSAConfig.from_hf({**BASE, "kv_lora_rank": latent, "qk_rope_head_dim": rope})
    g = torch.Generator().manual_seed(0)
    T, K, H, n, v = 3, 5, cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    kv_b = torch.randn(H * (n + v), latent, generator=g, dtype=torch.float64) * 0.05
    rows = torch.randn(T, K, latent + rope, generator=g, dtype=torch.float64)
    q_nope = torch.randn(T, H, n, generator=g, dtype=torch.float64)
    q_pe = torch.randn(T, H, rope, generator=g, dtype=torch.float64)
    valid = torch.tensor([[True] * 5, [True, False, True, False, True], [False] * 4 + [True]])
    o = mla.expand_values(
        mla.attend_rows(mla.absorb_query(q_nope, kv_b, cfg), q_pe, rows, valid, cfg.softmax_scale),
        kv_b,
        cfg,
    )
    # Expanded: per-head keys [k_nope | k_pe] and values from kv_b_proj, masked softmax.
    kvb = torch.einsum("tkc,oc->tko", rows[..., :latent], kv_b).view(T, K, H, n + v)
    keys = torch.cat([kvb[..., :n], rows[..., None, latent:].expand(T, K, H, rope)], -1)
    s = torch.einsum("thd,tkhd->thk", torch.cat([q_nope, q_pe], -1), keys) * cfg.softmax_scale
    assert cfg.softmax_scale == (n + rope) ** -0.5  # BASE's rope is plain: no YaRN mscale
    p = torch.softmax(s.masked_fill(~valid[:, None], float("-inf")), -1)
    want = torch.einsum("thk,tkhv->thv", p, kvb[..., n:]).reshape(T, H * v)
    assert torch.allclose(o, want, atol=1e-10)


def test_index_scores_equal_a_per_head_loop_and_top_k_is_causal():
    cfg = DSAConfig.from_hf(BASE)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 64, generator=g)
    w = torch.randn(2, 3, generator=g)
    keys = torch.randn(6, 64, generator=g)
    got = dsa_index.index_scores(q, w, keys, cfg)
    want = torch.zeros(2, 6)
    for h in range(3):
        want += w[:, h, None] / 3**0.5 * torch.relu(q[:, h] @ keys.T / 8.0)
    assert torch.allclose(got, want, atol=1e-6)
    sel = dsa_index.causal_top_k(got, torch.arange(6), torch.tensor([1, 5]), 4)
    assert sorted(sel[0, :2].tolist()) == [0, 1] and sel[0, 2:].tolist() == [-1, -1]
    assert set(sel[1].tolist()) == set(got[1].topk(4).indices.tolist())


def test_f32_rows_round_trip_exactly():
    kv = torch.randn(4, KV_DIM, dtype=torch.float32)
    rows = encode_rows(kv, "f32")
    assert rows.shape == (4, ROW_FORMATS["f32"].row_bytes) and rows.shape[1] % 16 == 0
    assert torch.equal(decode_rows(rows, "f32", torch.float32), kv)


def test_the_connector_refusal_of_a_dsa_checkpoint_names_the_override_to_add():
    from hisparse.vllm.model_check import _message

    line = _message("GlmMoeDsaForCausalLM")
    assert """--hf-overrides '{"architectures": ["HiSparseGlmMoeDsaForCausalLM"]}'""" in line
    assert "\n" not in line and "--hf-overrides" not in _message("LlamaForCausalLM")
