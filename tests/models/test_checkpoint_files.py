"""The files every exported checkpoint shares (``hisparse.models.checkpoint_files``), on their
own: the safetensors writer's header and bytes, its refusal of a dtype the format lacks, and
the byte-level tokenizer (one token per byte, printable, then ``<|endoftext|>``)."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from hisparse.models.checkpoint_files import (
    EOS_TOKEN,
    NUM_BYTE_TOKENS,
    tokenizer_files,
    write_safetensors,
)
from hisparse.models.export_dir import ExportError


def test_safetensors_header_and_bytes(tmp_path):
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).view(2, 3),
        "b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c": torch.zeros(0, dtype=torch.int64),
        "d": torch.tensor([0.5, 1.0], dtype=torch.float32).to(torch.float8_e4m3fn),
    }
    n = write_safetensors(tmp_path / "m.safetensors", tensors)
    raw = (tmp_path / "m.safetensors").read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    assert hlen % 8 == 0
    header = json.loads(raw[8 : 8 + hlen])
    assert header.pop("__metadata__") == {"format": "pt"}
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == {
        "a": ("F32", [2, 3]),
        "b": ("BF16", [2]),
        "c": ("I64", [0]),
        "d": ("F8_E4M3", [2]),
    }
    body = raw[8 + hlen :]
    assert len(body) == n == 24 + 4 + 0 + 2
    for name, t in tensors.items():
        a, b = header[name]["data_offsets"]
        got = torch.frombuffer(bytearray(body[a:b]), dtype=torch.uint8) if b > a else None
        want = t.contiguous().view(torch.uint8).flatten() if t.numel() else None
        assert (got is None and want is None) or torch.equal(got, want)


def test_safetensors_refuses_a_dtype_it_cannot_write(tmp_path):
    with pytest.raises(ExportError, match="'x' has dtype torch.complex64"):
        write_safetensors(tmp_path / "m.safetensors", {"x": torch.zeros(2, dtype=torch.complex64)})


def test_tokenizer_one_printable_token_per_byte_then_eos():
    files = tokenizer_files(128)
    assert sorted(files) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    vocab = files["tokenizer.json"]["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(NUM_BYTE_TOKENS))
    assert all(len(c) == 1 and c.isprintable() and not c.isspace() for c in vocab)
    (eos,) = files["tokenizer.json"]["added_tokens"]
    assert (eos["id"], eos["content"]) == (NUM_BYTE_TOKENS, EOS_TOKEN)
    assert files["tokenizer_config.json"]["model_max_length"] == 128
