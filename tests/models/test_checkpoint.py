"""`hisparse export-model`: the directory vLLM serves (config, seeded safetensors, tokenizer),
read back with an independent parser; the CLI's one-line errors; the plugin entry point."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from hisparse.models.checkpoint import (
    ARCHITECTURE,
    ExportError,
    config_from_hf,
    export_model,
    model_config,
)
from hisparse.models.reference import Model
from tests import REPO_ROOT
from tests.helpers import child_timeout

ROOT = REPO_ROOT
_DT = {"F32": torch.float32, "F64": torch.float64, "I64": torch.int64}


def _read_safetensors(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    body = raw[8 + n :]
    out = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        t = (
            torch.frombuffer(bytearray(body[a:b]), dtype=_DT[h["dtype"]])
            if b > a
            else torch.empty(0, dtype=_DT[h["dtype"]])
        )
        out[name] = t.reshape(h["shape"])
    return out


def test_export_writes_a_model_vllm_can_load(tmp_path):
    cfg = model_config(256, num_layers=3, index_share=2, top_k=16, hidden=32, vocab=300, seed=5)
    d = export_model(tmp_path / "m", cfg)
    hf = json.loads((d / "config.json").read_text())
    assert hf["architectures"] == [ARCHITECTURE] and hf["vocab_size"] == 300
    assert hf["max_position_embeddings"] == 256 and hf["num_hidden_layers"] == 3
    assert config_from_hf(hf) == cfg
    # A model exported before the row format's rename stores it as "row_layout".
    old = dict(
        hf,
        hisparse={("row_layout" if k == "row_format" else k): v for k, v in hf["hisparse"].items()},
    )
    assert "row_layout" in old["hisparse"] and config_from_hf(old) == cfg
    weights = _read_safetensors(d / "model.safetensors")
    ref = Model(cfg, torch.device("cpu"))
    assert torch.equal(weights["emb"], ref.emb) and torch.equal(weights["head"], ref.head)
    assert torch.equal(weights["layers.2.w_o"], ref.layers[2]["w_o"])
    assert torch.equal(weights["indexers.1.w_ik"], ref.indexers[1]["w_ik"])
    assert len(weights) == 3 + 7 * 3 + 2 * 2


def test_tokenizer_is_one_token_per_byte_plus_end_of_text(tmp_path):
    d = export_model(tmp_path / "m", model_config(64))
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    assert sorted(vocab.values()) == list(range(256)) and tok["model"]["merges"] == []
    assert all(len(c) == 1 and not c.isspace() for c in vocab)
    assert tok["added_tokens"][0] == {
        **tok["added_tokens"][0],
        "id": 256,
        "content": "<|endoftext|>",
    }
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|endoftext|>" and "chat_template" in cfg


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(vocab=100), "vocab must be >= 257"),
        (dict(top_k=0), "top_k"),
        (dict(hot=3), "hot is not a model setting"),
    ],
)
def test_bad_model_settings_are_named(kw, msg):
    with pytest.raises(ExportError, match=msg):
        model_config(128, **kw)


def test_cli_export_and_its_errors(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "hisparse", "export-model", "--arch", "reference", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=child_timeout(12),
        )

    ok = run(str(tmp_path / "out"), "--layers", "2", "--top-k", "8", "--max-model-len", "64")
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    for args, msg in [
        (["x", "--index-share", "3", "--layers", "2"], "--index-share: must be <= --layers"),
        (["x", "--vocab", "12"], "--vocab"),
        ([str(tmp_path / "out" / "config.json")], "not a directory"),
    ]:
        r = run(*args)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, (
            r.stderr
        )
    assert not (tmp_path / "x").exists()


def test_vllm_plugin_entry_point_is_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    plugins = meta["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"hisparse": "hisparse.vllm.plugin:register"}
    src = (ROOT / "hisparse" / "vllm" / "plugin.py").read_text()
    assert "ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)" in src
    assert "hisparse.vllm.model:HiSparseMLAForCausalLM" in src
