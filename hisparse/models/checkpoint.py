"""``hisparse export-model``: the reference sparse-MLA model as a directory vLLM serves offline.

The directory holds ``config.json`` (architecture ``HiSparseMLAForCausalLM``, the engine config
under ``hisparse``), ``model.safetensors`` (the seeded weights, float32) and a byte-level
tokenizer (256 byte tokens + ``<|endoftext|>``), so ``vllm serve DIR`` needs no network and text
prompts work through the OpenAI API. Nothing here imports vLLM.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, Mapping, Union

import torch

from hisparse.models.checkpoint_files import (
    EOS_TOKEN,
    NUM_BYTE_TOKENS,
    tokenizer_files,
    write_safetensors,
)
from hisparse.models.export_dir import ExportError, write_export
from hisparse.models.reference import Model
from hisparse.models.reference_config import MODEL_FIELDS, ReferenceConfig
from hisparse.models.rows import LATENT_DIM, ROPE_DIM

ARCHITECTURE = "HiSparseMLAForCausalLM"
CONFIG_KEY = "hisparse"
#: Positions are reserved in whole blocks of this many (as the engine reserves them).
CONTEXT_ROUND = 16


def model_config(max_model_len: int = 2048, **model_fields) -> ReferenceConfig:
    """The config of an exported model: float32, context ``max_model_len`` (rounded up to whole
    blocks of ``CONTEXT_ROUND``)."""
    unknown = sorted(set(model_fields) - set(MODEL_FIELDS))
    if unknown:
        raise ExportError(f"{unknown[0]} is not a model setting (known: {', '.join(MODEL_FIELDS)})")
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise ExportError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
    context = -(-max_model_len // CONTEXT_ROUND) * CONTEXT_ROUND
    try:
        cfg = ReferenceConfig(dtype="float32", max_context=context, **model_fields)
    except ValueError as e:
        raise ExportError(str(e)) from None
    if cfg.vocab < NUM_BYTE_TOKENS + 1:
        raise ExportError(
            f"vocab must be >= {NUM_BYTE_TOKENS + 1} (byte tokenizer + "
            f"{EOS_TOKEN}), got {cfg.vocab}"
        )
    return cfg


def hf_config(cfg: ReferenceConfig) -> dict:
    """config.json: a Llama-shaped header vLLM understands, the model itself under ``hisparse``."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "intermediate_size": 2 * cfg.hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 576,
        "vocab_size": cfg.vocab,
        "max_position_embeddings": cfg.max_context,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": NUM_BYTE_TOKENS,
        CONFIG_KEY: {
            **{k: getattr(cfg, k) for k in MODEL_FIELDS},
            "max_model_len": cfg.max_context,
        },
    }


def config_from_hf(hf: Union[Mapping, object]) -> ReferenceConfig:
    """The engine config stored in an exported config.json (a dict or a transformers config)."""
    block = hf.get(CONFIG_KEY) if isinstance(hf, Mapping) else getattr(hf, CONFIG_KEY, None)
    if not isinstance(block, Mapping):
        raise ExportError(
            f"config.json has no '{CONFIG_KEY}' section: not a model written by "
            "`hisparse export-model`"
        )
    # "row_layout": the row format's name in models exported before it was renamed.
    block = {("row_format" if k == "row_layout" else k): v for k, v in block.items()}
    fields = {k: block[k] for k in MODEL_FIELDS if k in block}
    return model_config(int(block.get("max_model_len", 2048)), **fields)


def model_weights(cfg: ReferenceConfig) -> Dict[str, torch.Tensor]:
    """The seeded weights by name (the same draws as the reference engine's ``Model``)."""
    return weights_by_name(Model(cfg, torch.device("cpu")))


def weight_bytes(cfg: ReferenceConfig) -> int:
    """Bytes of ``model_weights(cfg)``, counted from the shapes ``Model`` draws (float32)."""
    d, di = cfg.hidden, cfg.indexer_dim
    per_layer = d * (2 * LATENT_DIM + 2 * ROPE_DIM) + LATENT_DIM * d + 4 * d * d
    elems = 2 * cfg.vocab * d + cfg.max_context * di + cfg.num_layers * per_layer
    return 4 * (elems + cfg.num_groups * 2 * d * di)


def weights_by_name(m) -> Dict[str, torch.Tensor]:
    """A ``hisparse.models.reference.Model``'s weight tensors (the live ones) by file name."""
    out = {"emb": m.emb, "head": m.head, "index_pos": m.index_pos}
    for i, layer in enumerate(m.layers):
        out.update({f"layers.{i}.{k}": v for k, v in layer.items()})
    for g, idx in enumerate(m.indexers):
        out.update({f"indexers.{g}.{k}": v for k, v in idx.items()})
    return out


def export_model(
    out_dir: Union[str, os.PathLike], cfg: ReferenceConfig, *, force: bool = False
) -> Path:
    """Write config.json, model.safetensors and the tokenizer files as the directory ``out_dir``,
    swapped in whole (``hisparse.models.export_dir.write_export``; a non-empty ``out_dir`` that is
    not an earlier export is refused unless ``force``)."""

    def write(tmp: Path) -> None:
        files = {
            "config.json": hf_config(cfg),
            "generation_config.json": {"eos_token_id": NUM_BYTE_TOKENS},
            **tokenizer_files(cfg.max_context),
        }
        for name, payload in files.items():
            (tmp / name).write_text(json.dumps(payload, indent=1) + "\n")
        write_safetensors(tmp / "model.safetensors", model_weights(cfg))

    return write_export(out_dir, write, is_export_config, force)


def is_export_config(config: Mapping) -> bool:
    """``config`` (a parsed config.json) is one ``export_model`` wrote."""
    return config.get("architectures") == [ARCHITECTURE] and isinstance(
        config.get(CONFIG_KEY), Mapping
    )
