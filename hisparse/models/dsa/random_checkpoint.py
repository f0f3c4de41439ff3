"""A seeded tiny DeepSeek-V3.2 / GLM-5 checkpoint written without transformers: the config of
``hisparse.models.dsa.make_checkpoint`` (real latent sizes, a few layers and experts, GLM-5's
full/shared indexer pattern), random weights under the tensor names transformers uses, the byte
tokenizer. For tests and demos on machines without transformers; transformers reads it too.

    write_random_checkpoint(out_dir, "glm_moe_dsa", seed=0)

``export_random_checkpoint`` (``hisparse export-model --arch``) writes the same as a directory
swapped in whole (``hisparse.models.export_dir``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Union

import torch

from hisparse.models.checkpoint_files import tokenizer_files, write_safetensors
from hisparse.models.dsa import make_checkpoint as tiny
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.schema import DSAConfigError
from hisparse.models.export_dir import ExportError, write_export

ARCH_NAMES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}


def random_config(arch: str, **overrides) -> dict:
    """config.json of a tiny ``arch`` checkpoint (``make_checkpoint``'s fields)."""
    if arch not in ARCH_NAMES:
        raise ValueError(f"arch must be one of {sorted(ARCH_NAMES)}, got {arch!r}")
    hf = {**tiny._COMMON, **tiny._ARCH[arch], **overrides}
    rope = dict(hf["rope_parameters"])
    if rope["rope_type"] == "yarn" and "rope_parameters" not in overrides:
        # A YaRN rope covers original x factor positions: stretch it to the context asked for.
        rope["factor"] = max(
            rope["factor"], hf["max_position_embeddings"] / rope["original_max_position_embeddings"]
        )
        hf["rope_parameters"] = rope
    n = hf["num_hidden_layers"]
    if "indexer_types" in hf and "indexer_types" not in overrides:  # GLM-5's full / shared pairs
        hf["indexer_types"] = ["full" if i % 2 == 0 else "shared" for i in range(n)]
    k = min(hf["first_k_dense_replace"], n)
    hf.setdefault("mlp_layer_types", ["dense"] * k + ["sparse"] * (n - k))
    hf.update(architectures=[ARCH_NAMES[arch]], model_type=arch, torch_dtype="float32")
    return hf


def _layer(hf: dict, i: int, rand, norm) -> Dict[str, torch.Tensor]:
    hid, heads, qr = hf["hidden_size"], hf["num_attention_heads"], hf["q_lora_rank"]
    nope, v = hf["qk_nope_head_dim"], hf["v_head_dim"]
    c, r = hf["kv_lora_rank"], hf["qk_rope_head_dim"]
    p = f"model.layers.{i}."
    w = {p + "input_layernorm.weight": norm(hid), p + "post_attention_layernorm.weight": norm(hid)}
    a = p + "self_attn."
    w.update(
        {
            a + "q_a_proj.weight": rand(qr, hid),
            a + "q_a_layernorm.weight": norm(qr),
            a + "q_b_proj.weight": rand(heads * (nope + r), qr),
            a + "kv_a_proj_with_mqa.weight": rand(c + r, hid),
            a + "kv_a_layernorm.weight": norm(c),
            a + "kv_b_proj.weight": rand(heads * (nope + v), c),
            a + "o_proj.weight": rand(hid, heads * v),
        }
    )
    types = hf.get("indexer_types")
    if types is None or types[i] == "full":
        d, ih = hf["index_head_dim"], hf["index_n_heads"]
        w.update(
            {
                a + "indexer.wq_b.weight": rand(ih * d, qr),
                a + "indexer.wk.weight": rand(d, hid),
                a + "indexer.k_norm.weight": norm(d),
                a + "indexer.k_norm.bias": norm(d) - 1.0,
                a + "indexer.weights_proj.weight": rand(ih, hid),
            }
        )
    m = p + "mlp."
    if hf["mlp_layer_types"][i] == "dense":
        return {**w, **_mlp(m, hid, hf["intermediate_size"], rand)}
    e, mi = hf["n_routed_experts"], hf["moe_intermediate_size"]
    w[m + "gate.weight"] = rand(e, hid)
    w[m + "gate.e_score_correction_bias"] = 0.5 * rand(e)
    w.update(_mlp(m + "shared_experts.", hid, mi * hf["n_shared_experts"], rand))
    for x in range(e):
        w.update(_mlp(f"{m}experts.{x}.", hid, mi, rand))
    return w


def _mlp(p: str, hid: int, inter: int, rand) -> Dict[str, torch.Tensor]:
    return {
        p + "gate_proj.weight": rand(inter, hid),
        p + "up_proj.weight": rand(inter, hid),
        p + "down_proj.weight": rand(hid, inter),
    }


def random_weights(hf: dict, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Normal(0, initializer_range) matrices, norms near 1 (so loading them is exercised), an LM
    head scaled by ``make_checkpoint.HEAD_GAIN`` (wider logit gaps: fewer near-tie tokens)."""
    gen = torch.Generator().manual_seed(seed)
    std = hf["initializer_range"]

    def rand(*shape):
        return std * torch.randn(*shape, generator=gen)

    def norm(n):
        return 1.0 + rand(n)

    hid, vocab = hf["hidden_size"], hf["vocab_size"]
    w = {"model.embed_tokens.weight": rand(vocab, hid), "model.norm.weight": norm(hid)}
    for i in range(hf["num_hidden_layers"]):
        w.update(_layer(hf, i, rand, norm))
    w["lm_head.weight"] = tiny.HEAD_GAIN * rand(vocab, hid)
    return w


#: config.json key that marks a checkpoint ``export_random_checkpoint`` wrote (its seed).
EXPORT_MARK = "hisparse_random_seed"


def write_random_checkpoint(out_dir: Union[str, Path], arch: str, seed: int = 0, **overrides):
    """Write config.json, model.safetensors and the byte tokenizer of a tiny ``arch`` model."""
    hf = random_config(arch, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write(out, hf, seed)
    return out


def export_random_checkpoint(
    out_dir: Union[str, Path], arch: str, *, seed: int = 0, force: bool = False, **overrides
) -> Path:
    """``write_random_checkpoint`` into a fresh directory that replaces ``out_dir`` whole; a
    non-empty ``out_dir`` that is no earlier export is refused unless ``force``."""
    hf = {**random_config(arch, **overrides), EXPORT_MARK: seed}
    try:
        DSAConfig.from_hf(hf)
    except DSAConfigError as e:
        raise ExportError(str(e)) from None
    return write_export(out_dir, lambda tmp: _write(tmp, hf, seed), _is_export, force)


def _is_export(config: dict) -> bool:
    return EXPORT_MARK in config and config.get("architectures") in (
        [a] for a in ARCH_NAMES.values()
    )


def _write(out: Path, hf: dict, seed: int) -> None:
    write_safetensors(out / "model.safetensors", random_weights(hf, seed))
    files = {"config.json": hf, "generation_config.json": {"eos_token_id": hf["eos_token_id"]}}
    files.update(tokenizer_files(hf["max_position_embeddings"]))
    for name, payload in files.items():
        (out / name).write_text(json.dumps(payload, indent=1) + "\n")
