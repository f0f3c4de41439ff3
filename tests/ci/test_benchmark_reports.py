"""The report scripts read bench_decode_tpot.py's JSON: a change of its output that breaks them
fails here, not on the next device run. The kept H200 result is the core's (its "core" field)."""

from __future__ import annotations

import json
import sys

from tests import REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results"
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import capacity_report  # noqa: E402
import tpot_report  # noqa: E402


def _kept() -> dict:
    return json.loads((RESULTS / "engine_tpot_h200.json").read_text())


def test_the_kept_result_measures_the_core_vllm_runs():
    run = _kept()
    assert run["core"] == "hisparse.models.dsa.core"
    for row in run["batches"]:
        for key in ("resident_ms_per_step", "hisparse_ms_per_step", "ratio", "hit_rate"):
            assert row[key] > 0, key
        assert isinstance(row["fits_resident_budget"], bool) and row["bit_identical"] is True
    assert run["capacity"]["ratio"] > 1


def _external_run(name: str) -> dict:
    run = json.loads((RESULTS / f"engine_tpot_external_{name}.json").read_text())
    assert run["core"] == "hisparse.models.dsa.core"
    ran = {(r["attention"], r["indexer"]) for r in run["batches"]}
    assert ran == {("flashmla", "deepgemm")}
    assert all(r["bit_identical"] for r in run["batches"]) and run["capacity"]["ratio"] > 1
    assert run["per_request_layer_us"]["resident"] < run["per_request_layer_us"]["hisparse"]
    return run


def test_the_external_kernels_results_say_what_ran_and_where():
    _external_run("h200")  # the 32k run at five batches the docs cite
    for gpu in ("h200", "h100"):
        runs = [_external_run(f"{gpu}_ctx{ctx}") for ctx in (32768, 65536, 131072)]
        assert {gpu.upper() in r["device"] for r in runs} == {True}
        # Runs of different trees may share the table: each row names the commit it measured.
        kept = (RESULTS / f"capacity_by_context_external_{gpu}.md").read_text()
        assert capacity_report.table(runs) in kept
        for line, run in zip(capacity_report.table(runs).splitlines()[2:], runs):
            assert line.endswith(f"| {run['commit']} |"), line


def test_the_kernel_split_counts_flashmla_as_attention():
    import bench_decode_tpot

    def by_name(name):
        return next((c for pat, c in bench_decode_tpot._BY_NAME if pat in name), "rest")

    flashmla = (
        "void sm90::decode::sparse_fp8::flash_fwd_splitkv_mla_fp8_sparse_kernel<",
        "void smxx::decode::flash_fwd_mla_combine_kernel<cutlass::bfloat16_t",
    )
    assert [by_name(n) for n in flashmla] == ["attention", "attention"]
    split = json.loads((RESULTS / "kernel_split_external_h200.json").read_text())
    for row in split["kernel_split"]["batches"]:
        for mode in ("resident", "hisparse"):
            for cat, name, _ in row["per_layer"][mode]["kernels"]:
                assert "flash_fwd" not in name or cat.startswith("attention"), (cat, name)


def test_capacity_report_has_a_row_per_context_with_its_ratio():
    run = _kept()
    longer = json.loads(json.dumps(run))
    longer["capacity"].update(context=131072, ratio=3.25)
    lines = capacity_report.table([longer, run]).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| 32768 | 30 / 112 |")
    assert f"{run['capacity']['ratio']:.2f}x" in lines[2]
    assert lines[3].startswith("| 131072 |") and "3.25x" in lines[3]


def test_tpot_report_renders_the_kept_result():
    md = tpot_report.markdown(_kept())
    assert "| 112 | no |" in md and "attention: bmm" in md and "hisparse.models.dsa.core" in md


def test_the_kernel_split_hooks_every_core_call_of_the_step():
    """A core call the step makes but the split does not hook would file its kernels as 'rest'
    (as the query and attend_query calls were, the run after attend was split in two)."""
    import inspect
    import re
    from types import SimpleNamespace

    import bench_decode_tpot

    from hisparse.engine.graph.step import CoreStep

    called = set(re.findall(r"core\.(\w+)\(", inspect.getsource(CoreStep.forward)))
    hooks = bench_decode_tpot._split_hooks(SimpleNamespace(core=object(), layers=[]))
    hooked = {attr for _, attr, _ in hooks}
    assert {"select", "query", "attend_query"} <= called
    assert called - {"encode_rows"} <= hooked, called - hooked  # the row encoding is 'rest'


def test_per_request_layer_cost_is_the_slope_between_the_end_batches():
    import bench_decode_tpot

    rows = [
        {"batch": 16, "resident_ms_per_step": 5.0, "hisparse_ms_per_step": 5.5},
        {"batch": 1, "resident_ms_per_step": 4.0, "hisparse_ms_per_step": 4.1},
        {"batch": 101, "resident_ms_per_step": 12.0, "hisparse_ms_per_step": 14.1},
    ]
    got = bench_decode_tpot.per_request_layer_us(rows, layers=8)
    assert got == {"batches": [1, 101], "resident": 10.0, "hisparse": 12.5}
    assert bench_decode_tpot.per_request_layer_us(rows[:1], layers=8) == {}
    kept = _kept()["per_request_layer_us"]
    assert kept["batches"] == [1, 112] and 0 < kept["resident"] < kept["hisparse"]


def test_capacity_ceilings_price_the_misses_copy_from_the_runs_own_steps():
    run = {
        "config": {"layers": 8, "top_k": 2048},
        "capacity": {
            "context": 32768, "max_batch": {"resident": 30, "hisparse": 100},
            "tok_s": {"resident": 5000.0, "hisparse": 10000.0}, "ratio": 2.0, "hit_rate": 0.95,
        },
        "batches": [{"batch": 100, "resident_ms_per_step": 8.0, "hisparse_ms_per_step": 10.0,
                     "hit_rate": 0.95}],
    }  # fmt: skip
    row = capacity_report.ceilings([run], link_gbps=50.0).splitlines()[2]
    # 100 requests x 2048 x 5 % x 656 B = 6.72 MB per layer: 134 µs at 50 GB/s.
    free = 100 / 8.0e-3 / 5000  # resident's step at HiSparse's limit: 2.5x
    copied = 100 / (8.0e-3 + 8 * 6.7174e-3 / 50) / 5000
    assert row == f"| 32768 | 2.00x | {free:.2f}x | {copied:.2f}x | 6.72 MB | 134 µs | 250 µs |"
    run["batches"][0]["batch"] = 64  # the limit not timed in both modes: no ceiling
    untimed = capacity_report.ceilings([run]).splitlines()[2]
    assert untimed == "| 32768 | 2.00x | — | — | — | — | — |"


def test_the_kept_runs_sit_below_their_copy_free_ceiling():
    for gpu in ("h200", "h100"):
        runs = [_external_run(f"{gpu}_ctx{ctx}") for ctx in (32768, 65536, 131072)]
        for line in capacity_report.ceilings(runs).splitlines()[2:]:
            reached, free, copied = (float(x.strip(" x")) for x in line.split("|")[2:5])
            assert reached < copied < free, line
