"""hisparse.vllm.dsa.served_config without vLLM: at config time a DSA class's config.json,
context and row format are checked (each refusal one line naming the field or flag); other
architectures are not looked at."""

from __future__ import annotations

import types

import pytest

from hisparse.models.dsa.config import DSAConfigError
from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.vllm.dsa import served_config


def _vllm_config(arch="HiSparseDeepseekV32ForCausalLM", cache_dtype="auto", max_len=256, **over):
    hf = {**random_config("deepseek_v32"), **over}
    model = types.SimpleNamespace(
        architectures=[arch], hf_config=hf, max_model_len=max_len, dtype="torch.float32"
    )
    return types.SimpleNamespace(
        model_config=model, cache_config=types.SimpleNamespace(cache_dtype=cache_dtype)
    )


def test_the_row_format_follows_the_override_then_the_cache_dtype_then_the_dtype():
    vc = _vllm_config()
    cfg = served_config.DSAConfig.from_hf(vc.model_config.hf_config)
    assert served_config.row_format(vc, cfg) == "f32"
    assert served_config.row_format(_vllm_config(cache_dtype="fp8"), cfg) == "fp8"
    served_config.check(vc)  # nothing to refuse


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(cache_dtype="fp8_e5m2"), "--kv-cache-dtype fp8_e5m2"),
        (dict(cache_dtype="bfloat16", hisparse_row_format="fp8"), "drop one of them"),
        (dict(max_len=10**6), "--max-model-len 1000000 exceeds"),
        (dict(qk_rope_head_dim=63), "qk_rope_head_dim must be even"),
    ],
)
def test_what_a_dsa_class_cannot_serve_is_one_line(kw, words):
    with pytest.raises(DSAConfigError) as e:
        served_config.check(_vllm_config(**kw))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_other_architectures_are_not_looked_at():
    served_config.check(_vllm_config("LlamaForCausalLM", cache_dtype="fp8_e5m2"))
