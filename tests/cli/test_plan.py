"""`hisparse plan` against hand-computed cases (docs/plan.md)."""

from __future__ import annotations

import json

import pytest

from hisparse.cli import app as cli
from hisparse.cli.capacity import PlanError, PlanInputs, compute
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
    base = dict(
        layers=4,
        row_bytes=32,
        top_k=8,
        index_share=2,
        indexer_key_bytes=8,
        gpu_mem_gib=1,
        host_mem_gib=1,
        context=100,
        hot_size=16,
        miss_rate=0.1,
        pcie_gbps=1.0,
    )
    with pytest.raises(PlanError, match=flag):
        PlanInputs(**{**base, **kw})
