"""``hisparse export-model``: the reference sparse-MLA model as a directory vLLM serves offline.

The directory holds ``config.json`` (architecture ``HiSparseMLAForCausalLM``, the engine config
under ``hisparse``), ``model.safetensors`` (the seeded weights, float32) and a byte-level
tokenizer (256 byte tokens + ``<|endoftext|>``), so ``vllm serve DIR`` needs no network and text
prompts work through the OpenAI API. Nothing here imports vLLM.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from pathlib import Path
from typing import Dict, Mapping, Union

import torch

from hisparse.models.export_dir import ExportError, write_export
from hisparse.models.reference import Model
from hisparse.models.reference_config import MODEL_FIELDS, ReferenceConfig
from hisparse.models.rows import LATENT_DIM, ROPE_DIM

ARCHITECTURE = "HiSparseMLAForCausalLM"
CONFIG_KEY = "hisparse"
EOS_TOKEN = "<|endoftext|>"
NUM_BYTE_TOKENS = 256
#: Positions are reserved in whole blocks of this many (as the engine reserves them).
CONTEXT_ROUND = 16
_ST_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
}


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


def write_safetensors(path: Union[str, Path], tensors: Mapping[str, torch.Tensor]) -> int:
    """The safetensors format: u64 header length, JSON header, raw little-endian bytes; returns
    the data bytes written."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        if t.dtype not in _ST_DTYPES:
            raise ExportError(f"tensor {name!r} has dtype {t.dtype}, not one of {list(_ST_DTYPES)}")
        # Straight from the tensor's memory: Tensor.numpy() needs numpy, which the default
        # install does not have (x86 and arm64 are little-endian, as the format wants).
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) if t.numel() else b""
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)
    return offset


def _byte_chars() -> list:
    """Byte b -> a printable unicode character (the byte-level BPE alphabet): printable Latin-1
    bytes stand for themselves, the rest are shifted past 255 so no token is whitespace/control."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def tokenizer_files(max_model_len: int) -> Dict[str, dict]:
    """tokenizer.json (byte-level BPE, no merges: one token per byte) and its config."""
    vocab = {c: i for i, c in enumerate(_byte_chars())}
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": NUM_BYTE_TOKENS,
                "content": EOS_TOKEN,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "model_max_length": max_model_len,
        "clean_up_tokenization_spaces": False,
        "chat_template": (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
        ),
    }
    return {
        "tokenizer.json": tok,
        "tokenizer_config.json": tok_cfg,
        "special_tokens_map.json": {"eos_token": EOS_TOKEN},
    }


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
