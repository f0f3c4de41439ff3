"""The files every checkpoint hisparse writes shares, whatever its architecture: the
safetensors writer (no numpy, no safetensors package) and a byte-level tokenizer (256 byte tokens
and ``<|endoftext|>``), so vLLM serves the directory with no network and text prompts work
through its OpenAI API. Used by every checkpoint writer: ``hisparse.models.dsa.random_checkpoint``
(``hisparse export-model``), ``make_checkpoint``, ``fp8_weights``, ``mtp_checkpoint`` and the
demo's (``hisparse.cli.demo_model``).
"""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path
from typing import Dict, Mapping, Union

import torch

from hisparse.models.export_dir import ExportError

EOS_TOKEN = "<|endoftext|>"
NUM_BYTE_TOKENS = 256
_ST_DTYPES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
}


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
