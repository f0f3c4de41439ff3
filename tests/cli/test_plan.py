"""`hisparse plan` against hand-computed cases (docs/plan.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hisparse.cli import app as cli
from hisparse.cli.capacity import PlanError, PlanInputs, compute
from hisparse.cli.plan_model import model_from_config
from tests.plan_helpers import SMALL_PLAN


def _plan(capsys, *argv):
    rc = cli.main(["plan", *argv])
    return rc, capsys.readouterr().out


def test_deepseek_preset_by_hand(tmp_path, capsys):
    path = tmp_path / "p.json"
    rc, out = _plan(
        capsys,
        "--preset",
        "deepseek-v3.2",
        "--gpu-mem-gib",
        "40",
        "--host-mem-gib",
        "256",
        "--context",
        "40960",
        "--miss-rate",
        "0.05",
        "--pcie-gbps",
        "46",
        "--json",
        str(path),
    )
    assert rc == 0
    r = json.loads(path.read_text())
    # 61 layers x 656 B = 40016 B of rows per token; 61 indexers x 132 B = 8052 B of keys per token
    assert r["bytes_per_request"]["resident_device"] == 40960 * (40016 + 8052) == 1_968_865_280
    # hot: 61 layers x 4096 rows x 656 B, plus the indexer keys of every token
    assert (
        r["bytes_per_request"]["hisparse_device"] == 61 * 4096 * 656 + 40960 * 8052 == 493_715_456
    )
    assert r["bytes_per_request"]["hisparse_host"] == 40960 * 40016
    mc = r["max_concurrency"]
    assert mc["resident"] == 21  # 40 GiB = 42_949_672_960 B; 22 x 1.97e9 > that
    assert mc["hisparse_gpu_limit"] == 86
    assert mc["hisparse_host_limit"] == 167  # 256 GiB / 1_639_055_360 B
    assert mc["hisparse"] == 86 and mc["hisparse_limited_by"].startswith("GPU")
    st = r["decode_step"]
    # 86 requests x 102.4 misses x 61 layers x 656 B
    assert st["h2d_bytes"] == pytest.approx(86 * 102.4 * 61 * 656)
    assert st["h2d_ms"] == pytest.approx(86 * 102.4 * 61 * 656 / 46e9 * 1e3)
    assert "max concurrency, resident:    21" in out


def test_small_explicit_case_gpu_then_host_limited():
    base = SMALL_PLAN
    r = compute(PlanInputs(**base))
    assert r["index_groups"] == 2
    assert r["bytes_per_request"] == {
        "resident_device": 144_000,
        "hisparse_device": 18_048,
        "hisparse_host": 128_000,
    }
    mc = r["max_concurrency"]
    assert (mc["resident"], mc["hisparse_gpu_limit"], mc["hisparse_host_limit"]) == (7, 58, 65)
    assert mc["hisparse"] == 58 and mc["gain"] == pytest.approx(58 / 7)
    assert r["host_pool_bytes_at_max"] == 58 * 128_000
    assert r["decode_step"]["h2d_bytes"] == 10 * 2 * 4 * 32  # 2 misses/request/group x 4 layers
    assert r["decode_step"]["h2d_ms"] == pytest.approx(2560 / 1e9 * 1e3)
    r = compute(PlanInputs(**{**base, "host_mem_gib": 4 / 1024}))
    assert r["max_concurrency"]["hisparse"] == 32
    assert r["max_concurrency"]["hisparse_limited_by"].startswith("host")


def test_uneven_index_share_and_short_context():
    r = compute(
        PlanInputs(
            layers=78,
            row_bytes=656,
            top_k=2048,
            index_share=4,
            indexer_key_bytes=132,
            gpu_mem_gib=10,
            host_mem_gib=10,
            context=3000,
            hot_size=4096,
            miss_rate=0.0,
            pcie_gbps=46,
        )
    )
    assert r["index_groups"] == 20  # ceil(78 / 4)
    # the hot buffer never needs more rows than the context has tokens
    assert r["bytes_per_request"]["hisparse_device"] == 78 * 3000 * 656 + 3000 * 20 * 132
    assert r["decode_step"]["h2d_bytes"] == 0
    assert any("saves no device memory" in n for n in r["notes"])


def test_glm_preset_and_explicit_override(capsys):
    rc, out = _plan(capsys, "--preset", "glm-5.x", "--row-bytes", "1152")
    assert rc == 0
    assert "78 layers, 1152-B KV rows" in out and "20 indexers" in out


def test_resident_fits_nothing():
    r = compute(
        PlanInputs(
            layers=61,
            row_bytes=656,
            top_k=2048,
            index_share=1,
            indexer_key_bytes=132,
            gpu_mem_gib=1,
            host_mem_gib=100,
            context=40960,
            hot_size=2048,
            miss_rate=0.1,
            pcie_gbps=46,
        )
    )
    assert r["max_concurrency"]["resident"] == 0 and r["max_concurrency"]["gain"] is None


@pytest.mark.parametrize(
    "kw, flag",
    [
        ({"row_bytes": 100}, "--row-bytes"),
        ({"hot_size": 4}, "--hot-size"),
        ({"index_share": 9}, "--index-share"),
        ({"miss_rate": 1.5}, "--miss-rate"),
    ],
)
def test_bad_inputs_name_the_flag(kw, flag):
    with pytest.raises(PlanError, match=flag):
        PlanInputs(**{**SMALL_PLAN, **kw})


# --- `--model DIR` / `--config FILE` (tests/cli/fixtures) ------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"
DSV32 = FIXTURES / "deepseek_v32_config.json"
GLM5 = FIXTURES / "glm5_config.json"


def _plan_json(tmp_path, capsys, *argv):
    path = tmp_path / "plan.json"
    rc, out = _plan(capsys, *argv, "--json", str(path))
    assert rc == 0
    return json.loads(path.read_text()), out


def _model_dir(tmp_path, hf: dict):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf))
    return d


@pytest.mark.parametrize(
    "fixture, arch, layers", [(DSV32, "deepseek_v32", 61), (GLM5, "glm_moe_dsa", 78)]
)
def test_fixtures_parse_by_config_and_by_model_dir(fixture, arch, layers, tmp_path, capsys):
    r, out = _plan_json(tmp_path, capsys, "--config", str(fixture))
    assert r["model"]["arch"] == arch and r["inputs"]["layers"] == layers
    # both configs run an indexer on every layer (GLM-5 sets no index_topk_freq / indexer_types)
    assert r["index_groups"] == layers and r["model"]["index_share"] == 1
    assert (r["inputs"]["row_bytes"], r["inputs"]["top_k"]) == (656, 2048)
    assert r["inputs"]["indexer_key_bytes"] == 128 + 4
    d = _model_dir(tmp_path, json.loads(fixture.read_text()))
    r2, _ = _plan_json(tmp_path, capsys, "--model", str(d))
    assert r2["max_concurrency"] == r["max_concurrency"]


def test_deepseek_v32_parameter_count():
    """Published: 671 B total, 685 B with the MTP module's weights (DeepSeek-V3 model card).
    Our count by tensor shapes: 671.88 B for the main model (it includes the indexers' 0.85 B,
    which DeepSeek-V3 lacks), 685.36 B with the MTP layer as stored (its own embedding and head)."""
    hf = json.loads(DSV32.read_text())
    p = model_from_config(hf, "--config", str(DSV32))["params"]
    assert p["total"] == pytest.approx(671e9, rel=0.01)
    assert p["total"] == 671_877_944_064
    assert p["with_mtp"] == pytest.approx(685e9, rel=0.01)


def test_glm5_parameter_count():
    """GLM-5's fixture: transformers' GlmMoeDsaConfig defaults (configuration_glm_moe_dsa.py,
    documented against the checkpoint zai-org/GLM-5) agree with the GLM-5 technical report's
    table (arXiv:2602.15763, tabulated at glennklockwood.com/garden/GLM-5): 78 layers (3 dense +
    75 MoE, 1 MTP layer), hidden 6144, dense 12288, expert 2048, 64 heads, q/kv LoRA 2048/512,
    QK 192 + 64 rope, V 256, indexer 32 x 128, 256 + 1 experts, top-8, vocabulary 154880.
    Published size: 744 B (the report; transformers' GlmMoeDsa page: "a 744B-parameter
    mixture-of-experts model"). Not sourced, so left out of the fixture: rope settings and
    quantization (neither changes a size here)."""
    hf = json.loads(GLM5.read_text())
    p = model_from_config(hf, "--config", str(GLM5))["params"]
    assert p["total"] == pytest.approx(744e9, rel=0.01)


@pytest.mark.parametrize("sizes", [{}, {"kv_lora_rank": 42, "qk_rope_head_dim": 8}])
@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_parameter_count_matches_the_checkpoint_tensors(arch, sizes):
    # the seeded tiny checkpoint writes transformers' tensor names and shapes (GLM's with
    # shared-indexer layers): the count must be the sum of its tensors' sizes, at the released
    # latent sizes and at others
    from hisparse.models.dsa.random_checkpoint import random_config, random_weights

    hf = random_config(arch, **sizes)
    n = sum(t.numel() for t in random_weights(hf).values())
    assert model_from_config(hf, "--config", "tiny")["params"]["total"] == n


def test_deepseek_v32_32k_on_8_gpus_by_hand(tmp_path, capsys):
    r, out = _plan_json(
        tmp_path, capsys, "--config", str(DSV32), "--context", "32768", "--gpus", "8"
    )
    # per GPU: resident 32768 x (61 x 656 + 61 x 132) B; HiSparse 61 x 4096 x 656 + 32768 x 8052
    assert r["bytes_per_request"]["resident_device"] == 32768 * 48068 == 1_575_092_224
    assert r["bytes_per_request"]["hisparse_device"] == 163_905_536 + 263_847_936
    mc = r["max_concurrency"]  # 40 GiB = 42_949_672_960 B; 256 GiB host
    assert (mc["resident"], mc["hisparse"], mc["hisparse_host_limit"]) == (27, 100, 209)
    d = r["deployment"]
    assert (d["attention_ranks"], d["requests_resident"], d["requests_hisparse"]) == (8, 216, 800)
    assert d["host_pools"] == 8
    assert d["host_pool_bytes_total"] == 8 * 100 * 32768 * 40016  # 977.0 GiB pinned
    h2d = 100 * 102.4 * 61 * 656  # 0.410 GB per GPU per step
    assert d["h2d_bytes_per_gpu"] == pytest.approx(h2d)
    assert d["pcie_gbps_range"] == [14.2, 17.8]  # one-layer index groups from a 122 GiB pool
    assert d["copy_ms_range"] == pytest.approx([h2d / 17.8e6, h2d / 14.2e6])  # 23.0-28.9 ms
    c = (10.539 - 4.481) / (111 * 8)  # ms per request-layer, resident, 32k
    b = (4.481 - 8 * c) * 61 / 8
    assert d["tokens_per_s_resident"] == pytest.approx(8 * 27e3 / (b + 27 * 61 * c))
    assert d["tokens_per_s_hisparse_range"][0] == pytest.approx(
        8 * 100e3 / (b + 100 * 61 * c + h2d / 14.2e6)
    )
    assert "HiSparse 7,676-8,131" in out and "8 x 122.1 GiB = 977.0 GiB" in out


def test_regime_lines_dp_and_tp(tmp_path, capsys):
    r, out = _plan_json(tmp_path, capsys, "--config", str(DSV32), "--gpus", "8")
    want = "of KV per GPU|per host pool|DP attention over 8 GPU(s)|8 pool(s)|copy: not hidden"
    for text in (want + "|14.2-17.8 GB/s per GPU|measured on one H200").split("|"):
        assert text in out, text
    r8, out8 = _plan_json(tmp_path, capsys, "--config", str(DSV32), "--gpus", "8", "--tp", "8")
    assert "TP 8" in out8 and "MLA rows are replicated" in out8
    d8 = r8["deployment"]
    assert (d8["host_pools"], d8["requests_hisparse"]) == (1, r["max_concurrency"]["hisparse"])
    assert d8["h2d_bytes_all_gpus"] == 8 * d8["h2d_bytes_per_gpu"]  # every rank copies
    r, out = _plan_json(tmp_path, capsys, "--config", str(DSV32), "--pcie-gbps", "30")
    assert r["deployment"]["pcie_gbps_range"] == [30, 30] and "given by --pcie-gbps" in out


def test_uneven_index_groups_from_indexer_types(tmp_path, capsys):
    # IndexShare: the first layers full, then one indexer per 4 layers (transformers' rule)
    hf = {**json.loads(GLM5.read_text()), "index_topk_freq": 4, "index_skip_topk_offset": 3}
    r, _ = _plan_json(tmp_path, capsys, "--model", str(_model_dir(tmp_path, hf)))
    assert r["model"]["group_sizes"] == [1, 1] + [4] * 19
    assert r["index_groups"] == 21 and r["inputs"]["index_groups"] == 21
    lo, hi = r["deployment"]["pcie_gbps_range"]
    assert lo == pytest.approx(78 / (2 / 14.2 + 76 / 46.3), abs=1e-3)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--model", "/nonexistent/hisparse-ckpt"], "--model"),
        (["--config", "/nonexistent/config.json"], "--config"),
        (["--config", str(DSV32), "--preset", "glm-5.x"], "--preset"),
        (["--config", str(DSV32), "--gpus", "8", "--tp", "3"], "--tp"),
    ],
)
def test_bad_model_source_is_one_line_naming_the_flag(argv, flag, capsys):
    _exits_2_naming(flag, argv, capsys)


def test_bad_model_dirs_name_the_flag(tmp_path, capsys):
    not_dsa = json.dumps({**json.loads(DSV32.read_text()), "qk_rope_head_dim": 63})
    for name, text, why in [
        ("empty", None, "has no config.json"),
        ("bad", "{not json", "not readable JSON"),
        ("dsa", not_dsa, "qk_rope_head_dim"),  # DSAConfig's own error, in one line
    ]:
        (tmp_path / name).mkdir()
        if text is not None:
            (tmp_path / name / "config.json").write_text(text)
        assert why in _exits_2_naming("--model", ["--model", str(tmp_path / name)], capsys)


def _exits_2_naming(flag, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(["plan", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("hisparse plan: error:"), err
    assert flag in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("override,want", [(None, 132), ("fp8", 132), ("f32", 512)])
def test_index_key_bytes_follow_the_key_format(override, want):
    hf = json.loads(DSV32.read_text())
    if override:
        hf["hisparse_key_format"] = override
    assert model_from_config(hf, "--config", str(DSV32))["indexer_key_bytes"] == want


def test_an_unknown_key_format_is_named():
    hf = json.loads(DSV32.read_text()) | {"hisparse_key_format": "int4"}
    with pytest.raises(PlanError, match="--config.*index key format"):
        model_from_config(hf, "--config", str(DSV32))


def test_the_copy_rate_falls_with_the_host_range_between_the_measured_points():
    from hisparse.cli.copy_rate import GBPS_BY_RANGE, GBPS_COLOCATED, gather_gbps, range_gbps

    for size, rate in GBPS_BY_RANGE:  # each measured point as measured
        assert range_gbps(size) == pytest.approx(rate)
    assert range_gbps(1 << 30) == GBPS_BY_RANGE[0][1]  # flat up to the first point
    assert range_gbps(1e12) == GBPS_BY_RANGE[-1][1]  # and past the last
    sizes = [4e9 * 1.1**i for i in range(25)]
    lows = [range_gbps(s)[0] for s in sizes]
    assert all(a >= b for a, b in zip(lows, lows[1:])) and lows[0] > lows[-1]
    # Halfway (in log) between 9.6 and 19.3 GB: halfway between their rates.
    mid = range_gbps((9.6e9 * 19.3e9) ** 0.5)
    assert mid == pytest.approx(((38.2 + 27.3) / 2, (42.3 + 33.4) / 2), abs=1e-3)
    lo, hi, where = gather_gbps([1] * 8, 12e9)
    assert 27.3 < lo < 38.2 and 33.4 < hi < 42.3 and "11.2 GiB" in where
    assert gather_gbps([4] * 4, 12e9)[:2] == GBPS_COLOCATED  # groups of 4: one translation
    assert "at most 4.5 GiB" in gather_gbps([1], 4e9)[2]
