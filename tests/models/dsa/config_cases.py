"""Config cases of test_config_schema.py: released DeepSeek-V3.2 / GLM-5 configs, the table
of invalid fields, a config-object stand-in, and the hypothesis strategy of random valid tiny
configs with their single-field invalid variants."""

from __future__ import annotations

import math

from hypothesis import strategies as st

from hisparse.models.dsa import schema
from hisparse.models.dsa.random_checkpoint import random_config

#: config.json of the released DeepSeek-V3.2 (weights' quantization and MTP fields included).
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}
_GLM_LAYERS = 78
#: config.json of GLM-5 (transformers 5 spelling: rope_parameters, indexer_types).
GLM5 = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "dtype": "bfloat16",
    "first_k_dense_replace": 3,
    "head_dim": 192,
    "hidden_act": "silu",
    "hidden_size": 6144,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_share_for_mtp_iteration": True,
    "index_skip_topk_offset": 3,
    "index_topk": 2048,
    "index_topk_freq": 4,
    "index_topk_pattern": None,
    "indexer_types": ["shared" if max(i - 3 + 1, 0) % 4 else "full" for i in range(_GLM_LAYERS)],
    "intermediate_size": 12288,
    "kv_lora_rank": 512,
    "max_position_embeddings": 1048576,
    "mlp_layer_types": ["dense" if i < 3 else "sparse" for i in range(_GLM_LAYERS)],
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": _GLM_LAYERS,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 2048,
    "qk_head_dim": 256,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "rope_parameters": {"rope_theta": 8000000, "rope_type": "default"},
    "v_head_dim": 256,
    "vocab_size": 154880,
}

_YARN = {"rope_type": "yarn", "rope_theta": 1e4}
#: (fields over a tiny random_config of either arch, the key the refusal must name).
INVALID = [
    *[({"num_attention_heads": v}, "num_attention_heads") for v in ("4", 4.5, True, 0, -4)],
    *[({"index_topk": v}, "index_topk") for v in (16.7, 0, -1, 10**6, 2**40, "16", False)],
    ({"index_topk": 600, "max_position_embeddings": 512}, "index_topk"),
    *[({"vocab_size": v}, "vocab_size") for v in (-1, 1, "258", 258.0)],
    ({"v_head_dim": 0}, "v_head_dim"),
    ({"qk_nope_head_dim": -8}, "qk_nope_head_dim"),
    *[({"rms_norm_eps": v}, "rms_norm_eps") for v in (-1e-6, 0, math.nan, "1e-6", True, 1.5)],
    *[({"rope_theta": v}, "rope_theta") for v in (-10000, 0, 1, "1e4", math.inf)],
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta"),
    *[({"num_experts_per_tok": v}, "num_experts_per_tok") for v in (0, 100, 2.0)],
    *[({"n_group": v}, "n_group") for v in (0, 3, "2")],
    *[({"topk_group": v}, "topk_group") for v in (0, 3)],
    *[({"n_routed_experts": v}, "n_routed_experts") for v in (0, 8.0)],
    ({"rope_parameters": _YARN}, "factor"),
    ({"rope_parameters": None, "rope_scaling": {"type": "yarn"}}, "factor"),
    *[({"rope_parameters": {**_YARN, "factor": v}}, "factor") for v in (0, -40, "40", None)],
    ({"rope_parameters": {**_YARN, "factor": 4, "beta_fast": 0}}, "beta_fast"),
    ({"rope_parameters": {**_YARN, "factor": 4, "mscale_all_dim": -1}}, "mscale_all_dim"),
    (
        {"rope_parameters": {**_YARN, "factor": 4, "original_max_position_embeddings": 4096.0}},
        "original_max_position_embeddings",
    ),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ({"rope_parameters": "yarn"}, "rope_parameters"),
    *[({"kv_lora_rank": v}, "kv_lora_rank") for v in (0, "512", 512.0)],
    ({"kv_lora_rank": 200, "hisparse_row_format": "fp8"}, "kv_lora_rank"),
    *[({"qk_rope_head_dim": v}, "qk_rope_head_dim") for v in (0, 63)],
    *[({"q_lora_rank": v}, "q_lora_rank") for v in (None, 0)],
    ({"index_head_dim": 32}, "index_head_dim"),
    ({"index_n_heads": 0}, "index_n_heads"),
    *[({"hidden_size": v}, "hidden_size") for v in ("abc", 0, 2**21)],
    *[({"num_hidden_layers": v}, "num_hidden_layers") for v in (0, 2048, 4.0)],
    *[({"max_position_embeddings": v}, "max_position_embeddings") for v in (0, 2**31)],
    ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
    *[({"routed_scaling_factor": v}, "routed_scaling_factor") for v in (0, -2.5)],
    *[({"norm_topk_prob": v}, "norm_topk_prob") for v in ("true", 1)],
    ({"tie_word_embeddings": 0}, "tie_word_embeddings"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hisparse_row_format": "int4"}, "hisparse_row_format"),
    *[({"mlp_layer_types": v}, "mlp_layer_types") for v in ("dense", ["dense"])],
    *[({"moe_intermediate_size": v}, "moe_intermediate_size") for v in (0, "64")],
    ({"n_shared_experts": -1}, "n_shared_experts"),
    ({"index_topk_freq": 0}, "index_topk_freq"),
    ({"index_topk_pattern": "FXFS"}, "index_topk_pattern"),
    ({"indexer_rope_interleave": 1}, "indexer_rope_interleave"),
]
#: GLM-5 only (DeepSeek-V3.2 runs every layer's indexer and reads no index pattern).
GLM_INVALID = [
    ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types"),
    ({"indexer_types": ["full"] * 3}, "indexer_types"),
    ({"indexer_types": "FFFF"}, "indexer_types"),
    ({"indexer_types": None, "index_topk_pattern": "FSF"}, "index_topk_pattern"),
    ({"indexer_types": None, "index_skip_topk_offset": -1}, "index_skip_topk_offset"),
    (
        {"indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 0},
        "index_skip_topk_offset",
    ),
    ({"indexer_types": None, "index_topk_pattern": "SFSF"}, "index_topk_pattern"),
]


class HFConfig:
    """A transformers / vLLM config stand-in: fields are attributes; the rest read as unset."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


def as_object(hf: dict, **extra) -> HFConfig:
    return HFConfig(**{**hf, **extra})


@st.composite
def tiny_configs(draw, arch=None) -> dict:
    """A valid tiny config of ``arch`` (else either) in either spelling, as config.json holds it."""
    arch = arch or draw(st.sampled_from(("deepseek_v32", "glm_moe_dsa")))
    layers = draw(st.integers(1, 3))
    groups, per = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    top_groups = draw(st.integers(1, groups))
    positions = draw(st.integers(16, 512))
    rope_dim = draw(st.sampled_from([2, 4, 8, 16, 64]))  # the released models: 512 + 64
    hf = random_config(
        arch,
        num_hidden_layers=layers,
        hidden_size=draw(st.sampled_from([8, 16, 32])),
        num_attention_heads=draw(st.integers(1, 4)),
        q_lora_rank=draw(st.integers(1, 24)),
        qk_nope_head_dim=draw(st.integers(1, 16)),
        v_head_dim=draw(st.integers(1, 16)),
        index_topk=draw(st.integers(1, min(24, positions))),
        index_n_heads=draw(st.integers(1, 4)),
        kv_lora_rank=draw(st.sampled_from([1, 7, 42, 128, 512])),
        qk_rope_head_dim=rope_dim,
        index_head_dim=draw(st.integers(rope_dim, rope_dim + 16)),
        vocab_size=draw(st.integers(2, 300)),
        max_position_embeddings=positions,
        n_routed_experts=groups * per,
        n_group=groups,
        topk_group=top_groups,
        num_experts_per_tok=draw(st.integers(1, top_groups * per)),
        first_k_dense_replace=draw(st.integers(0, layers + 1)),
        intermediate_size=draw(st.integers(1, 32)),
        moe_intermediate_size=draw(st.integers(1, 16)),
        n_shared_experts=draw(st.integers(1, 2)),
        rms_norm_eps=draw(st.floats(1e-7, 1e-2)),
        routed_scaling_factor=draw(st.floats(0.25, 4.0)),
        norm_topk_prob=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
    )
    theta = draw(st.sampled_from([100, 10000.0, 500000]))  # config.json writes ints too
    rope = {"rope_type": "default"}
    if draw(st.booleans()):
        rope = {
            "rope_type": "yarn",
            "factor": draw(st.sampled_from([1, 4.0, 40])),
            "original_max_position_embeddings": draw(st.integers(1, positions)),
            "mscale": draw(st.sampled_from([0, 1.0, 0.707])),
            "mscale_all_dim": draw(st.sampled_from([0, 1.0])),
        }
    del hf["rope_parameters"]
    if draw(st.booleans()):  # transformers 5
        hf["rope_parameters"] = {**rope, "rope_theta": theta}
    else:  # older configs and vLLM: rope_scaling with "type", rope_theta beside it
        kind = rope.pop("rope_type")
        hf.update(rope_scaling={**rope, "type": kind}, rope_theta=theta)
    if arch == "glm_moe_dsa":
        spelling = draw(st.sampled_from(["types", "pattern", "freq"]))
        kinds = ["full"] + [draw(st.sampled_from(["full", "shared"])) for _ in range(layers - 1)]
        hf["indexer_types"] = kinds if spelling == "types" else None
        if spelling == "pattern":
            hf["index_topk_pattern"] = "".join(k[0].upper() for k in kinds)
        elif spelling == "freq":
            hf["index_topk_freq"] = freq = draw(st.integers(1, 3))
            hf["index_skip_topk_offset"] = draw(st.integers(0 if freq == 1 else 1, 3))
    return hf


def mutations(hf: dict) -> list:
    """(key, config) pairs: ``hf`` with one field made invalid, the key its refusal names."""
    out = []

    def put(key: str, **fields) -> None:
        out.append((key, {**hf, **fields}))

    for name, (lo, hi, _) in schema.INTS.items():
        v = hf.get(name) or max(lo, 1)
        for bad in (str(v), float(v), True, lo - 1, hi + 1):
            put(name, **{name: bad})
    for name, (lo, hi, _) in schema.REALS.items():
        v = hf.get(name) or 2.0
        for bad in (str(v), False, lo, -abs(v), math.nan, math.inf, *([hi] if hi else [])):
            put(name, **{name: bad})
    for name in schema.BOOLS:
        put(name, **{name: 1})
    for name, choices in schema.CHOICES.items():
        put(name, **{name: choices[0].upper()})
    put("index_topk", index_topk=hf["max_position_embeddings"] + 1)
    put("num_experts_per_tok", num_experts_per_tok=hf["n_routed_experts"] + 1)
    put("n_routed_experts", n_group=hf["n_routed_experts"] + 1)
    put("topk_group", topk_group=hf["n_group"] + 1)
    put("qk_rope_head_dim", qk_rope_head_dim=hf["qk_rope_head_dim"] + 1)  # odd
    put("index_head_dim", index_head_dim=hf["qk_rope_head_dim"] - 1)
    put("kv_lora_rank", kv_lora_rank=129, hisparse_row_format="fp8")  # not whole fp8 tiles
    src = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    for field, bad in (("factor", None), ("factor", 0), ("rope_theta", 1), ("rope_type", "ntk")):
        rope = {**hf[src], "rope_type": "yarn", field: bad}
        rope.pop("type", None)
        put(field, **{src: rope})
    return out
