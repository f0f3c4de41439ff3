"""bench_kernels.py's report (benchmarks/baselines): every row carries ours and the baseline's
µs, the rate in TFLOP/s or GB/s and the baseline's commit or the reason it is absent, in the JSON
and the markdown; the indexer's float64 reference reads the key cache's layout as the core
stores it."""

from __future__ import annotations

import json
import sys

import torch

from tests import REPO_ROOT

sys.path[:0] = [str(REPO_ROOT / "benchmarks" / "baselines"), str(REPO_ROOT / "benchmarks")]

import bench_kernels as bk  # noqa: E402


def _rows() -> list:
    ours = dict(impl="bmm", us=200.0, spread_us=[190.0, 210.0], err=0.004)
    there = dict(impl="FlashMLA", us=100.0, spread_us=[99.0, 101.0], err=0.003, commit="9241ae3")
    gone = dict(impl="DeepGEMM fp8_paged_mqa_logits", absent="not importable (ImportError: x)")
    return [
        bk.make_row(
            "sparse MLA decode", "batch 64", "TFLOP/s", 2e9, ours, there, 989.0, checked=True
        ),  # fmt: skip
        bk.make_row(
            "DSA indexer scores",
            "batch 1 x 32768 keys",
            "GB/s",
            4.3e6,
            ours,
            gone,
            4800.0,
            checked=False,
        ),  # fmt: skip
    ]


def test_rows_have_both_times_rates_and_the_commit_or_the_reason(tmp_path):
    res = dict(device="GPU", method="m.", commit="abc", torch="2", rows=_rows(), notes=["n."])
    bk.write(res, tmp_path / "k.json", tmp_path / "k.md")
    got = json.loads((tmp_path / "k.json").read_text())["rows"]
    mla, idx = got
    assert mla["ours_us"] == 200.0 and mla["baseline_us"] == 100.0
    assert mla["ours_rate"] == 10.0 and mla["baseline_rate"] == 20.0  # TFLOP/s
    assert mla["baseline_commit"] == "9241ae3" and mla["baseline_absent"] is None
    assert mla["ours_vs_baseline"] == 2.0 and abs(mla["ours_of_peak"] - 10 / 989) < 1e-12
    assert idx["baseline_us"] is None and idx["baseline_rate"] is None
    assert idx["baseline_absent"].startswith("not importable") and idx["ours_rate"] == 21.5
    md = (tmp_path / "k.md").read_text().splitlines()
    table = [line for line in md if line.startswith("| ")]
    assert len(table) == 3  # header and one line per row
    assert "FlashMLA @ 9241ae3" in table[1] and "100.0 (99.0-101.0)" in table[1]
    assert "10.0 TFLOP/s" in table[1] and "2.00x" in table[1] and table[1].endswith("| yes |")
    assert "not importable" in table[2] and "21.5 GB/s" in table[2]
    assert md[-1] == "n."


def test_bad_arguments_are_refused(capsys):
    for argv in (["--parts", "mla,foo"], ["--index-contexts", "1000"], ["--reps", "0"]):
        try:
            bk.parse(argv)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(argv)
    args = bk.parse(["--parts", "topk", "--index-batches", "2"])
    assert args.parts == ["topk"] and args.index_batches == [2]


def test_the_indexer_reference_reads_the_core_key_layout():
    from hisparse.models.dsa import index_keys

    g = torch.Generator().manual_seed(0)
    B, L = 2, 128
    cache = torch.zeros(B * L // bk.BLOCK, bk.BLOCK * bk.KEY, dtype=torch.uint8)
    k = torch.randn(B * L, bk.IDX_DIM, generator=g)
    index_keys.store_keys(cache, torch.arange(B * L), k, "fp8", bk.BLOCK)
    q = torch.randn(bk.IDX_HEADS, bk.IDX_DIM, generator=g)
    hw = torch.randn(bk.IDX_HEADS, generator=g)
    keys = index_keys.load_keys(cache, torch.arange(L, 2 * L), "fp8", bk.IDX_DIM, bk.BLOCK)
    want = (torch.relu(q.double() @ keys.double().T) * hw.double()[:, None]).sum(0)
    got = bk._index_reference(cache, q, hw, 1, L)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-9)  # load_keys decodes in float32


def test_the_kernel_split_renders_a_row_per_category_with_its_slopes():
    import bench_decode_tpot as bdt

    cats = (*bdt.SPLIT, "rest", "total")

    def mode(scale):
        return {"per_layer_us": {c: scale * (i + 1) for i, c in enumerate(cats)}, "graph_us": 9}

    rows = [{"batch": b, "per_layer": {m: mode(b) for m in bdt.MODES}} for b in (1, 64)]
    slope = {m: {**{c: 0.5 for c in cats}, "graph": 0.25} for m in bdt.MODES}
    split = {
        "config": {"context": 32768, "layers": 4, "attention": "bmm"},
        "rounds": 3, "steps": 20, "split_steps": 3,
        "kernel_split": {"batches": rows, "per_request_layer_us": slope, "between": [1, 64]},
    }  # fmt: skip
    md = bk.split_markdown(split)
    table = [line for line in md if line.startswith("| ")]
    assert len(table) == 1 + len(cats) + 1  # header, categories, the captured step
    assert table[0].startswith("| category | resident b1 µs | resident b64 µs | hisparse b1")
    assert table[1].startswith("| indexer | 1.0 | 64.0 | 1.0 | 64.0 | 0.500 | 0.500 |")
    assert table[-1] == "| captured step per layer | 9.0 | 9.0 | 9.0 | 9.0 | 0.250 | 0.250 |"
