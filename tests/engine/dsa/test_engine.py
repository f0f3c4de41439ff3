"""The DSA engine (hisparse.engine.dsa) on the CPU with tiny DeepSeek-V3.2 / GLM-5 checkpoints
written without transformers: resident and HiSparse give bit-identical tokens in every row
format, GLM-5's index groups follow the indexer pattern, bad directories fail in one line, and
``hisparse demo --model`` runs the parity demo."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from hisparse.engine.dsa.generate import byte_prompts, generate, parity
from hisparse.engine.dsa.stores import HiSparseRows
from hisparse.models.checkpoint_files import write_safetensors
from hisparse.models.dsa.random_checkpoint import (
    random_config,
    random_weights,
    write_random_checkpoint,
)
from hisparse.models.dsa.weights import CheckpointError, load_checkpoint
from tests.engine.dsa.helpers import ARCHS, OTHER_SIZES, one_thread, tie_aware_mismatch

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsa")
    return {a: write_random_checkpoint(root / a, a, seed=3) for a in ARCHS}


@pytest.mark.parametrize("row_format", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_resident_and_hisparse_tokens_are_bit_identical(checkpoints, arch, row_format):
    with one_thread():
        s = parity(str(checkpoints[arch]), CPU, row_format, num_prompts=2, max_new=10)
    assert s["prompt_tokens"][0] >= 4 * s["index_topk"]  # the selection matters
    assert s["hot_size"] < s["prompt_tokens"][0]  # the hot buffer cannot hold the context
    assert s["tokens"]["resident"] == s["tokens"]["hisparse"], s
    # every decode step resolved index_topk entries once per index group (a full layer)
    c, groups = s["hisparse_counters"], s["indexer_types"].count("full")
    assert c["hits"] + c["misses"] == 2 * 9 * s["index_topk"] * groups, c
    assert c["misses"] > 0 and c["host_to_device_bytes"] > 0, c
    text = s["tokens"]["resident"][0]
    assert len(set(text)) > 3, f"generation is one repeated token: {text}"


@pytest.mark.parametrize("row_format", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_other_latent_sizes_keep_the_tokens_bit_identical(tmp_path, arch, row_format):
    sizes = OTHER_SIZES[arch]
    d = write_random_checkpoint(tmp_path / arch, arch, seed=5, **sizes)
    if row_format == "fp8" and sizes["kv_lora_rank"] % 128:
        with pytest.raises(CheckpointError) as e:
            parity(str(d), CPU, row_format, num_prompts=1, max_new=2)
        assert "--row-format fp8 needs kv_lora_rank" in str(e.value)
        assert "\n" not in str(e.value)
        return
    with one_thread():
        s = parity(str(d), CPU, row_format, num_prompts=2, max_new=8)
    assert s["tokens"]["resident"] == s["tokens"]["hisparse"], s
    c = s["hisparse_counters"]
    assert c["misses"] > 0, c
    row = load_checkpoint(d, CPU).cfg.row_bytes(row_format)
    assert row % 16 == 0 and c["host_to_device_bytes"] % row == 0, (row, c)
    assert len(set(s["tokens"]["resident"][0])) > 3, s["tokens"]


def test_a_skipped_save_breaks_parity(checkpoints, monkeypatch):
    """Negative control: HiSparse really reads what it saved to the host pool."""
    real = HiSparseRows.save

    def lossy(self, layer, rows, keys):
        real(self, layer, rows if layer != 1 else torch.zeros_like(rows), keys)

    monkeypatch.setattr(HiSparseRows, "save", lossy)
    with one_thread():
        s = parity(str(checkpoints["glm_moe_dsa"]), CPU, "f32", num_prompts=1, max_new=6)
    assert not s["parity"]


@pytest.mark.parametrize(
    "pattern, groups",
    [
        (["full", "shared", "full", "shared"], [2, 2]),
        (["full", "shared", "shared", "full"], [3, 1]),
    ],
)
def test_glm_index_groups_follow_the_indexer_pattern(tmp_path, pattern, groups):
    d = write_random_checkpoint(tmp_path / "glm", "glm_moe_dsa", indexer_types=pattern)
    ck = load_checkpoint(d, CPU)
    assert [ck.cfg.leader(i) for i in range(4)] == [
        max(j for j in range(i + 1) if pattern[j] == "full") for i in range(4)
    ]
    store = HiSparseRows(ck.cfg, 2304, 128, CPU, 32)
    try:
        assert [len(g.members) for g in store.worker.worker.groups] == groups
    finally:
        store.close()
    with one_thread():
        prompts = byte_prompts(ck, 1)
        runs = [generate(ck, m, "fp8", CPU, prompts, 6) for m in ("resident", "hisparse")]
    assert runs[0].tokens == runs[1].tokens


def _bad_checkpoint(tmp_path, case):
    d = tmp_path / case
    d.mkdir()
    hf = random_config("deepseek_v32")
    w = random_weights(hf)
    if case == "not_dsa":
        hf["model_type"], hf["architectures"] = "llama", ["LlamaForCausalLM"]
    elif case == "rope":
        hf["qk_rope_head_dim"] = 63
    elif case == "missing_tensor":
        del w["model.layers.2.self_attn.indexer.wk.weight"]
    (d / "config.json").write_text(json.dumps(hf))
    if case == "quantized":  # one float8 tensor, as the released DeepSeek-V3.2 weights hold
        head = json.dumps({"w": {"dtype": "F8_E4M3", "shape": [16], "data_offsets": [0, 16]}})
        head = head.encode() + b" " * (-len(head) % 8)
        raw = struct.pack("<Q", len(head)) + head + bytes(16)
        (d / "model.safetensors").write_bytes(raw)
    elif case != "no_weights":
        write_safetensors(d / "model.safetensors", w)
    return d


@pytest.mark.parametrize(
    "case, words",
    [
        ("no_dir", "no such directory"),
        ("no_config", "no config.json"),
        ("not_dsa", "neither deepseek_v32 nor glm_moe_dsa"),
        ("rope", "qk_rope_head_dim must be even"),
        ("no_weights", "no *.safetensors"),
        ("missing_tensor", "model.layers.2.self_attn.indexer.wk.weight"),
        ("quantized", "tensor 'w' is F8_E4M3; only unquantized checkpoints"),
    ],
)
def test_a_bad_directory_fails_in_one_line_naming_what_is_wrong(tmp_path, case, words):
    if case == "no_dir":
        d = tmp_path / "absent"
    elif case == "no_config":
        d = tmp_path
    else:
        d = _bad_checkpoint(tmp_path, case)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d, CPU)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_prefill_in_query_chunks_gives_the_same_tokens(checkpoints, monkeypatch):
    """Long prompts attend in chunks of query tokens (HiSparse reads the prompt rows back from
    the pool once per layer and step); chunks of 8 change no token and keep parity."""
    from hisparse.engine.dsa import model

    ck = load_checkpoint(checkpoints["deepseek_v32"], CPU)
    prompts = byte_prompts(ck, 1)
    with one_thread():
        whole = generate(ck, "resident", "f32", CPU, prompts, 6)
        monkeypatch.setattr(model, "CHUNK_ELEMS", 8 * ck.cfg.index_topk * 576 + 1)
        runs = [generate(ck, m, "f32", CPU, prompts, 6) for m in ("resident", "hisparse")]
    assert runs[0].tokens == runs[1].tokens
    assert tie_aware_mismatch(whole.tokens[0], runs[0].tokens[0], whole.gaps[0]) is None


def test_fused_expert_tensors_load_like_per_expert_ones(checkpoints, tmp_path):
    """Some transformers versions save experts fused (gate_up_proj [E, 2I, H], down_proj)."""
    from hisparse.models.dsa.weights import read_safetensors

    src = checkpoints["deepseek_v32"]
    w = read_safetensors(src / "model.safetensors", CPU)
    for i in range(1, 4):
        p = f"model.layers.{i}.mlp.experts."
        n = sum(1 for k in w if k.startswith(p) and k.endswith("down_proj.weight"))
        gate_up = [
            torch.cat([w.pop(f"{p}{e}.gate_proj.weight"), w.pop(f"{p}{e}.up_proj.weight")])
            for e in range(n)
        ]
        w[p + "gate_up_proj"] = torch.stack(gate_up)
        w[p + "down_proj"] = torch.stack([w.pop(f"{p}{e}.down_proj.weight") for e in range(n)])
    d = tmp_path / "fused"
    d.mkdir()
    write_safetensors(d / "model.safetensors", w)
    (d / "config.json").write_text((src / "config.json").read_text())
    a, b = load_checkpoint(src, CPU), load_checkpoint(d, CPU)
    for i in range(4):
        assert a.ffn[i].keys() == b.ffn[i].keys()
        assert all(torch.equal(a.ffn[i][k], b.ffn[i][k]) for k in a.ffn[i])
