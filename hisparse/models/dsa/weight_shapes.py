"""The shape config.json gives each tensor of a DeepSeek-V3.2 / GLM-5 checkpoint, under the names
transformers writes: checked against the files' headers before any weight is read, by the
engine's loader and by the vLLM classes' (whose parameters may be tensor-parallel shards, so the
config, not the parameter, says what the checkpoint must hold).

    expected_shapes(hf, cfg, block)  # name -> shape; block: the FP8 block size or None
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.fp8_weights import is_quantized, scale_name, scale_shape

Shape = Tuple[int, ...]


def _get(hf: Any, name: str, default: Any = None) -> Any:
    v = hf.get(name) if isinstance(hf, Mapping) else getattr(hf, name, None)
    return default if v is None else v


def _dense(hf: Any, i: int) -> bool:
    kinds = _get(hf, "mlp_layer_types")
    if kinds is not None:
        return kinds[i] == "dense"
    return i < int(_get(hf, "first_k_dense_replace", 0))


def _mlp(p: str, hid: int, inter: int) -> Dict[str, Shape]:
    return {
        p + "gate_proj.weight": (inter, hid),
        p + "up_proj.weight": (inter, hid),
        p + "down_proj.weight": (hid, inter),
    }


def _attention(a: str, cfg: DSAConfig) -> Dict[str, Shape]:
    hid, heads, qr = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank
    nope, v, c = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    return {
        a + "q_a_proj.weight": (qr, hid),
        a + "q_a_layernorm.weight": (qr,),
        a + "q_b_proj.weight": (heads * (nope + cfg.qk_rope_head_dim), qr),
        a + "kv_a_proj_with_mqa.weight": (cfg.kv_dim, hid),
        a + "kv_a_layernorm.weight": (c,),
        a + "kv_b_proj.weight": (heads * (nope + v), c),
        a + "o_proj.weight": (hid, heads * v),
    }


def _indexer(a: str, cfg: DSAConfig) -> Dict[str, Shape]:
    d, ih = cfg.index_head_dim, cfg.index_n_heads
    return {
        a + "indexer.wq_b.weight": (ih * d, cfg.q_lora_rank),
        a + "indexer.wk.weight": (d, cfg.hidden_size),
        a + "indexer.k_norm.weight": (d,),
        a + "indexer.k_norm.bias": (d,),
        a + "indexer.weights_proj.weight": (ih, cfg.hidden_size),
    }


def expected_shapes(
    hf: Any, cfg: DSAConfig, block: Optional[Sequence[int]] = None
) -> Dict[str, Shape]:
    """Every tensor name the checkpoint may hold for the served layers -> its shape; with
    ``block``, each quantizable weight's ``weight_scale_inv`` too. Experts appear both per expert
    and fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])."""
    hid = cfg.hidden_size
    vocab = int(_get(hf, "vocab_size"))
    out: Dict[str, Shape] = {
        "model.embed_tokens.weight": (vocab, hid),
        "model.norm.weight": (hid,),
        "lm_head.weight": (vocab, hid),
    }
    experts = int(_get(hf, "n_routed_experts", 0) or _get(hf, "num_local_experts", 0))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (hid,)
        out[p + "post_attention_layernorm.weight"] = (hid,)
        out.update(_attention(p + "self_attn.", cfg))
        if cfg.is_full(i):
            out.update(_indexer(p + "self_attn.", cfg))
        m = p + "mlp."
        if _dense(hf, i):
            out.update(_mlp(m, hid, int(_get(hf, "intermediate_size"))))
            continue
        mi = int(_get(hf, "moe_intermediate_size"))
        out[m + "gate.weight"] = (experts, hid)
        out[m + "gate.e_score_correction_bias"] = (experts,)
        shared = int(_get(hf, "n_shared_experts", 0))
        if shared:
            out.update(_mlp(m + "shared_experts.", hid, mi * shared))
        for e in range(experts):
            out.update(_mlp(f"{m}experts.{e}.", hid, mi))
        out[m + "experts.gate_up_proj"] = (experts, 2 * mi, hid)
        out[m + "experts.down_proj"] = (experts, hid, mi)
    if block is not None:
        out.update(
            {scale_name(n): scale_shape(s, block) for n, s in out.items() if is_quantized(n)}
        )
    return out


def shape_error(where: str, name: str, got: Sequence[int], want: Sequence[int]) -> str:
    """The one line for a tensor whose shape is not the config's."""
    return (
        f"{where}: tensor {name!r} has shape {list(got)}; config.json makes it {list(want)} "
        "(a checkpoint of another model, or a corrupt header)"
    )
