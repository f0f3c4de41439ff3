"""The pure-torch decoder pieces of hisparse.models.dsa (decoder.py, projections.py): rotary
frequencies and scale against transformers' own (default and YaRN in the spellings real
configs use; skipped without transformers' DeepSeek-V3.2 classes), the two rotary layouts, MoE
routing by hand, and the config fields' one-line errors."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.dsa.config import DSAConfig, DSAConfigError
from hisparse.models.dsa.decoder import (
    DecoderSpec,
    Rotary,
    moe,
    rope_half,
    rope_interleaved,
    route,
)
from hisparse.models.dsa.projections import select_sorted
from hisparse.models.dsa.random_checkpoint import random_config

YARNS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    # released DeepSeek-V3.2: mscale == mscale_all_dim, so the cos/sin scale is 1
    {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 4096,
    },
    # no mscale_all_dim: the scale is 0.1 ln(factor) + 1
    {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
    },
]


def _cfg(rope: dict, **over) -> tuple:
    hf = random_config("deepseek_v32", rope_parameters=rope, **over)
    cfg = DSAConfig.from_hf(hf)
    return hf, cfg, DecoderSpec.from_hf(hf, cfg)


@pytest.mark.parametrize("rope", YARNS, ids=["default", "yarn_v32", "yarn_no_mscale"])
def test_rotary_matches_transformers(rope):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV32Config"):
        pytest.skip("transformers lacks DeepseekV32Config")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, cfg, spec = _cfg(dict(rope))
    tcfg = transformers.DeepseekV32Config(**{k: v for k, v in hf.items() if k != "architectures"})
    if rope["rope_type"] == "default":
        want = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
        want_scale = 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS["yarn"](tcfg, torch.device("cpu"))
    got = Rotary(cfg, spec.max_positions, torch.device("cpu"))
    assert torch.equal(got.inv_freq, want.float())
    assert got.scale == pytest.approx(want_scale, rel=0, abs=0)


def test_the_two_rotary_layouts_rotate_pairs_by_the_same_angles():
    torch.manual_seed(0)
    hf, cfg, spec = _cfg(YARNS[0])
    cos, sin = Rotary(cfg, spec.max_positions, torch.device("cpu"))(torch.arange(5))
    x = torch.randn(5, 64)
    # interleaved pairs (x0, x1) ... laid out half-split are rotated as rotate_half rotates them
    half_split = torch.cat([x[:, 0::2], x[:, 1::2]], dim=-1)
    assert torch.allclose(rope_interleaved(x, cos, sin), rope_half(half_split, cos, sin))
    assert torch.allclose(rope_half(x, cos, sin).norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_grouped_routing_picks_experts_only_from_the_best_groups():
    hf, cfg, spec = _cfg(YARNS[0], n_routed_experts=8, n_group=4, topk_group=2)
    torch.manual_seed(1)
    w = {
        "gate.weight": torch.randn(8, hf["hidden_size"]),
        "gate.e_score_correction_bias": torch.randn(8),
    }
    x = torch.randn(6, hf["hidden_size"])
    weights, ids = route(x, w, spec)
    choice = torch.sigmoid(x @ w["gate.weight"].T) + w["gate.e_score_correction_bias"]
    best_groups = choice.view(6, 4, 2).sum(-1).topk(2, dim=-1).indices  # 2 experts per group
    for t in range(6):
        assert set((ids[t] // 2).tolist()) <= set(best_groups[t].tolist())
    scores = torch.sigmoid(x @ w["gate.weight"].T).gather(1, ids)
    want = scores / scores.sum(-1, keepdim=True) * spec.routed_scaling_factor
    assert torch.allclose(weights, want)


def test_the_dense_moe_is_the_routed_moe():
    """The capturable form (every expert over every token, weight 0 where not chosen) against
    the routed one: the same sum up to float32 rounding; a wrong share would be off by whole
    experts' outputs."""
    hf, cfg, spec = _cfg(YARNS[0], n_routed_experts=8, n_group=4, topk_group=2)
    g = torch.Generator().manual_seed(2)
    d, inter = hf["hidden_size"], 24
    w = {
        "gate.weight": torch.randn(8, d, generator=g),
        "gate.e_score_correction_bias": torch.randn(8, generator=g),
    }
    for p in [f"experts.{e}." for e in range(8)] + ["shared_experts."]:
        w[p + "gate_proj.weight"] = torch.randn(inter, d, generator=g) * d**-0.5
        w[p + "up_proj.weight"] = torch.randn(inter, d, generator=g) * d**-0.5
        w[p + "down_proj.weight"] = torch.randn(d, inter, generator=g) * inter**-0.5
    x = torch.randn(7, d, generator=g)
    want = moe(x, w, spec)
    assert torch.allclose(moe(x, w, spec, dense=True), want, rtol=1e-5, atol=1e-5)
    w["experts.3.up_proj.weight"] = w["experts.3.up_proj.weight"] * 2  # the control
    assert not torch.allclose(moe(x, w, spec, dense=True), want, rtol=1e-5, atol=1e-5)


def test_selection_is_sorted_causal_and_padded():
    hf, cfg, _ = _cfg(YARNS[0], index_topk=4)
    torch.manual_seed(2)
    q, w = torch.randn(3, cfg.index_n_heads, cfg.index_head_dim), torch.randn(3, cfg.index_n_heads)
    sel = select_sorted(q, w, torch.randn(10, cfg.index_head_dim), torch.tensor([1, 5, 9]), cfg)
    assert sel[0].tolist() == [0, 1, -1, -1]  # two visible keys, then padding
    for row, pos in zip(sel[1:], (5, 9)):
        assert row.tolist() == sorted(row.tolist()) and max(row.tolist()) <= pos


@pytest.mark.parametrize(
    "over, words",
    [
        ({"hidden_act": "gelu"}, "hidden_act must be 'silu'"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types must list"),
        ({"n_routed_experts": 6, "n_group": 4}, "must split into n_group"),
    ],
)
def test_decoder_fields_fail_in_one_line(over, words):
    with pytest.raises(DSAConfigError, match=words):
        _cfg(YARNS[0], **over)
