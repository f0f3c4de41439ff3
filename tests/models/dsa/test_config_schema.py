"""The DSA config schema (hisparse.models.dsa.schema) behind DSAConfig.from_hf and
DecoderSpec.from_hf: invalid fields are refused in one line naming the key and the value (no
int() / float() coercion), released DeepSeek-V3.2 / GLM-5 configs are accepted as dicts and as
config objects, a bad config is named before any weight file is read (engine and CLI), and a
seeded property test: random valid tiny configs build and run a decode step, single-field
invalid variants of them are refused by name."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse import cli
from hisparse.engine.dsa.generate import generate
from hisparse.models.checkpoint_files import write_safetensors
from hisparse.models.dsa.config import DSAConfig, DSAConfigError
from hisparse.models.dsa.decoder import DecoderSpec
from hisparse.models.dsa.random_checkpoint import random_config, random_weights
from hisparse.models.dsa.weights import CheckpointError, load_checkpoint
from tests.engine.dsa.helpers import one_thread
from tests.models.dsa.config_cases import (
    DEEPSEEK_V32,
    GLM5,
    GLM_INVALID,
    INVALID,
    as_object,
    mutations,
    tiny_configs,
)

CPU = torch.device("cpu")


def build(hf):
    cfg = DSAConfig.from_hf(hf)
    return cfg, DecoderSpec.from_hf(hf, cfg)


def refusal(hf) -> str:
    with pytest.raises(DSAConfigError) as e:
        build(hf)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _shows(msg: str, value) -> bool:
    return value is None or repr(value) in msg or str(value) in msg


CASES = [(a, o, k) for a in ("deepseek_v32", "glm_moe_dsa") for o, k in INVALID]
CASES += [("glm_moe_dsa", o, k) for o, k in GLM_INVALID]


@pytest.mark.parametrize(
    "arch, over, key", CASES, ids=[f"{a[:3]}-{k}-{i}" for i, (a, _, k) in enumerate(CASES)]
)
def test_an_invalid_field_is_refused_naming_key_and_value(arch, over, key):
    hf = {**random_config(arch), **over}
    for config in (hf, as_object(hf)):  # config.json and a transformers / vLLM config object
        msg = refusal(config)
        assert key in msg, msg
        if key in over and not isinstance(over[key], (dict, list)):
            assert _shows(msg, over[key]), msg


def test_messages_name_key_rule_and_value():
    hf = random_config("deepseek_v32", index_topk=600, max_position_embeddings=512)
    want = "config.json: index_topk must be <= max_position_embeddings (512), got 600"
    assert refusal(hf) == want
    hf = random_config("deepseek_v32", n_routed_experts=6)
    del hf["n_group"], hf["topk_group"]  # transformers' DeepSeek-V3.2 defaults: 8 groups
    assert refusal(hf) == (
        "config.json: n_routed_experts must split into n_group (8 by default) equal groups, got 6"
    )
    hf = random_config("deepseek_v32", hidden_size="abc")
    assert refusal(hf) == "config.json: hidden_size must be an integer, got str 'abc'"


def test_released_configs_are_accepted_as_dicts_and_objects():
    for hf in (DEEPSEEK_V32, GLM5):
        cfg, spec = build(hf)
        assert (cfg, spec) == build(as_object(hf))
        assert cfg.index_topk == 2048 and spec.max_positions == hf["max_position_embeddings"]
    cfg, spec = build(DEEPSEEK_V32)
    assert cfg.arch == "deepseek_v32" and cfg.indexer_types == ("full",) * 61
    mscale = 0.1 * math.log(40) + 1.0
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert (spec.n_group, spec.topk_group, spec.experts_per_token) == (8, 4, 8)
    assert spec.dense == (True,) * 3 + (False,) * 58
    cfg, spec = build(GLM5)
    assert cfg.indexer_types == tuple(GLM5["indexer_types"]) and cfg.indexer_rope_interleave
    assert (spec.rms_norm_eps, spec.routed_scaling_factor) == (1e-5, 2.5)  # transformers' defaults


def test_transformers_normalised_deepseek_config_is_accepted():
    """transformers 5 / vLLM config objects: rope_parameters with rope_theta inside and floats
    where config.json wrote ints, None for unset fields, torch dtypes and other extra fields."""
    rope = {**DEEPSEEK_V32["rope_scaling"], "factor": 40.0, "rope_type": "yarn", "rope_theta": 1e4}
    hf = {k: v for k, v in DEEPSEEK_V32.items() if k not in ("rope_scaling", "rope_theta")}
    obj = as_object(
        {**hf, "rope_parameters": rope, "rope_scaling": rope, "index_topk_pattern": None},
        torch_dtype=torch.bfloat16,
        num_local_experts=None,
        head_dim=64,
        qk_head_dim=192,
    )
    assert build(obj) == build(DEEPSEEK_V32)


@pytest.mark.parametrize("via", ["load_checkpoint", "cli"])
def test_a_bad_config_is_named_before_any_weight_file(tmp_path, capsys, via):
    """No weights in the directory: the config error comes first, naming the key."""
    hf = random_config("glm_moe_dsa", index_topk=0)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    if via == "load_checkpoint":
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(tmp_path, CPU)
        msg = str(e.value)
    else:
        with pytest.raises(SystemExit) as e:
            cli.main(["demo", "--model", str(tmp_path)])
        assert e.value.code == 2
        msg = capsys.readouterr().err.strip()
    assert msg.endswith("config.json: index_topk must be >= 1, got 0"), msg
    assert str(tmp_path) in msg and "\n" not in msg


def _run_one_decode_step(hf: dict, seed: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        write_safetensors(Path(d) / "model.safetensors", random_weights(hf, seed))
        (Path(d) / "config.json").write_text(json.dumps(hf))
        ck = load_checkpoint(d, CPU)
    vocab = ck.spec.vocab_size
    n = min(ck.cfg.index_topk + 5, ck.spec.max_positions - 1)
    prompt = [(7 * i + seed) % vocab for i in range(n)]
    with one_thread():
        run = generate(ck, "resident", "f32", CPU, [prompt], 2)  # prefill + one decode step
    assert len(run.tokens[0]) == 2 and all(0 <= t < vocab for t in run.tokens[0])
    assert torch.isfinite(run.first_logits[0]).all()


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_random_valid_configs_build_and_run_a_decode_step(arch):
    @settings(max_examples=25, deadline=None, derandomize=True, database=None)
    @given(hf=tiny_configs(arch), seed=st.integers(0, 2**16))
    def check(hf, seed):
        assert build(hf) == build(as_object(hf))
        _run_one_decode_step(hf, seed)

    check()


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_single_field_invalid_variants_are_refused_by_name(data):
    hf = data.draw(tiny_configs())
    key, bad = data.draw(st.sampled_from(mutations(hf)))
    msg = refusal(bad)
    assert key in msg, (key, msg)
    assert refusal(as_object(bad)) == msg
    with tempfile.TemporaryDirectory() as d:  # a directory without weights: config first
        (Path(d) / "config.json").write_text(json.dumps(bad, allow_nan=True))
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(d, CPU)
    assert str(e.value).endswith(msg), str(e.value)
