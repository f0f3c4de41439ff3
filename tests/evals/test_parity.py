"""The parity eval (evals/parity) on its CI profiles: HiSparse (and hybrid residency) vs
all-resident on the DSA engine under memory pressure must be bit-identical, and the negative
controls (base-offset binding, a hybrid spill one row short) must be caught. Also checks that
the comparator and the coverage rules can fail."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from tests import REPO_ROOT
from tests.helpers import child_timeout

REPO = str(REPO_ROOT)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from evals.parity import run_parity as cli  # noqa: E402
from evals.parity.parity import (  # noqa: E402
    NEGATIVE_CONTROL,
    NEGATIVE_CONTROL_SCENARIO,
    SPILL_CONTROL_SCENARIO,
    ParityReport,
    bit_identical_rows,
    compare_pair,
    run_parity,
    scenarios,
    token_agreement,
)
from evals.parity.runs import Checkpoints, prompts, run  # noqa: E402
from hisparse.engine.dsa.stores import BLOCK  # noqa: E402

RUN_PARITY = os.path.join(REPO, "evals", "parity", "run_parity.py")
CPU = torch.device("cpu")


def _cli(profile: str, out) -> tuple:
    proc = subprocess.run(
        [sys.executable, RUN_PARITY, "--profile", profile, "--json", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=child_timeout(60),
        cwd="/",
    )
    return proc, json.loads(out.read_text()) if out.exists() else None


@pytest.fixture(scope="module")
def ci_report(tmp_path_factory):
    """The whole CI profile through the CLI, as a user runs it (script mode, JSON out)."""
    return _cli("ci", tmp_path_factory.mktemp("parity") / "parity.json")


def test_ci_profile_passes_with_full_parity(ci_report):
    proc, doc = ci_report
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert doc is not None and doc["passed"] is True and doc["engine"] == "hisparse.engine.dsa"
    assert doc["identical_token_pct"] == 100.0
    parity = [p for p in doc["pairs"] if p["kind"] == "parity"]
    assert len(doc["seeds"]) >= 3
    assert {(p["scenario"], p["seed"]) for p in parity} == {
        (s.name, seed) for s in scenarios("ci") for seed in doc["seeds"]
    }
    for p in parity:
        assert p["identical_tokens"] == p["total_tokens"] > 0, p
        assert p["attention_rows_identical"] == p["attention_rows_total"] > 0, p
        assert p["attention_layers_identical"] == p["attention_layers_total"] >= 2, p
        assert p["hidden_identical"] and p["coverage_problems"] == [], p
        assert p["misses"] > 0 and p["host_to_device_bytes"] > 0
    assert "overall PASS" in proc.stdout


def test_ci_profile_covers_the_memory_pressure_cases(ci_report):
    _, doc = ci_report
    cov = [p["coverage"] for p in doc["pairs"] if p["kind"] == "parity"]
    assert {c["index_group"] for c in cov} == {1, 2, 4}  # DeepSeek-V3.2, GLM-5 groups
    assert any(c["hot_over_top_k"] == 1.0 for c in cov)  # hot == top-k
    assert max(c["context_over_hot"] for c in cov) >= 16  # long contexts
    assert all(c["evictions_lower_bound"] > 0 for c in cov)  # eviction everywhere
    assert all(c["requests"] > c["batch_rows"] for c in cov)  # state rows reused
    assert {c["row_bytes"] for c in cov} == {656, 1152}  # both row layouts
    assert all(c["device_kv_ratio"] <= 0.25 for c in cov)  # memory pressure


def test_negative_control_is_detected(ci_report):
    proc, doc = ci_report
    controls = [p for p in doc["pairs"] if p["kind"] == "negative-control"]
    assert len(controls) == len(doc["seeds"]) and doc["negative_control_detected"] is True
    for c in controls:
        assert c["scenario"] == NEGATIVE_CONTROL_SCENARIO
        assert c["verdict"] == "FAIL" and c["parity_ok"] is False and c["ok"] is True
        assert "refused at bind time" in c["note"] and "overlap in memory" in c["note"]
        assert c["identical_tokens"] < c["total_tokens"]
        assert c["attention_rows_identical"] < c["attention_rows_total"]
    assert "FAIL (detected)" in proc.stdout
    assert "negative control (base-offset binding): detected" in proc.stdout


# ----------------------------------------------------------------------------- can it fail?


def test_bit_comparison_is_on_raw_bits():
    a = torch.tensor([[0.0, 1.0], [2.0, float("nan")]], dtype=torch.float64)
    assert bit_identical_rows(a, a.clone()) == (2, 2)  # NaN with the same bits: equal
    b = a.clone()
    b[0, 0] = -0.0  # == compares equal, bits differ
    assert bit_identical_rows(a, b) == (1, 2)
    c = a.clone()
    c[0, 1] = torch.nextafter(
        torch.tensor(1.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    )
    assert bit_identical_rows(a, c) == (1, 2)  # one ulp
    assert bit_identical_rows(a, a[:1]) == (0, 2)  # shape mismatch
    assert bit_identical_rows(a.float(), a.float()) == (2, 2)
    assert token_agreement([[1, 2, 3], [4]], [[1, 2, 3], [4]]) == (4, 4)
    assert token_agreement([[1, 2, 3], [4]], [[1, 9, 3]]) == (2, 4)  # missing request counts


@pytest.fixture(scope="module")
def small_pair():
    base = scenarios("ci", ["state-row-reuse"])[0]
    sc = dataclasses.replace(base, workload=dataclasses.replace(base.workload, requests=4))
    cks = Checkpoints(CPU)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield sc, run(cks, sc.workload, 7, "resident"), run(cks, sc.workload, 7, "hisparse")
    finally:
        torch.set_num_threads(prev)
        cks.close()


def test_runs_record_every_layer_and_the_device_rows(small_pair):
    sc, res, hs = small_pair
    w = sc.workload
    assert sorted(hs.attention) == list(range(w.layers))
    prompt_rows = sum(len(p) for p in prompts(w, 7, 257))
    for out in hs.attention.values():  # every prompt token, then every decode
        assert out.shape[0] == prompt_rows + w.requests * (w.max_new - 1)
    assert hs.final_hidden.shape[0] == w.requests * w.max_new  # one per generated token
    ctx = -(-(w.longest) // BLOCK) * BLOCK
    assert res.device_kv_bytes == w.layers * w.max_batch * ctx * w.row_bytes
    assert hs.device_kv_bytes == w.layers * w.max_batch * w.hot_size * w.row_bytes


def test_one_flipped_attention_bit_fails_parity(small_pair):
    sc, res, hs = small_pair
    assert compare_pair(sc, 7, res, hs, "parity").parity_ok
    att = {k: v.clone() for k, v in hs.attention.items()}
    bits = att[max(att)].view(torch.int32)
    bits[len(bits) // 2, 3] ^= 1  # least significant mantissa bit
    bad = dataclasses.replace(hs, attention=att)
    pr = compare_pair(sc, 7, res, bad, "parity")
    assert pr.identical_tokens == pr.total_tokens  # tokens alone would not see it
    assert not pr.parity_ok and pr.verdict == "FAIL"
    assert pr.attention_rows_identical == pr.attention_rows_total - 1
    hidden = hs.final_hidden.clone()
    hidden.view(torch.int32)[0, 0] ^= 1
    pr = compare_pair(sc, 7, res, dataclasses.replace(hs, final_hidden=hidden), "parity")
    assert not pr.parity_ok and not pr.hidden_identical and pr.attention_layers_identical
    missing = dataclasses.replace(hs, attention=None)
    assert not compare_pair(sc, 7, res, missing, "parity").parity_ok


def test_a_token_difference_fails_parity_and_is_located(small_pair):
    sc, res, hs = small_pair
    toks = [list(t) for t in hs.tokens]
    toks[1][2] += 1
    pr = compare_pair(sc, 7, res, dataclasses.replace(hs, tokens=toks), "parity")
    assert not pr.parity_ok and pr.first_mismatch == (1, 2)
    assert pr.identical_tokens == pr.total_tokens - 1


def test_an_undetected_negative_control_fails_the_eval(small_pair):
    sc, res, hs = small_pair
    good = compare_pair(sc, 7, res, hs, "parity")
    # a "control" that matches the reference means the eval cannot see the bug
    blind = compare_pair(sc, 7, res, hs, "negative-control")
    assert blind.parity_ok and not blind.ok
    report = ParityReport(profile="ci", device="cpu", seeds=[7], pairs=[good, blind], wall_s=0)
    assert good.ok and not report.passed and report.negative_control_detected is False
    assert "NOT DETECTED" in report.table() and "overall FAIL" in report.table()
    assert ParityReport("ci", "cpu", [7], [good], 0).passed  # control skipped: parity only
    assert not ParityReport("ci", "cpu", [7], [], 0).passed  # nothing ran: not a pass


def test_a_workload_that_stops_exercising_the_spill_path_fails(small_pair):
    sc, res, hs = small_pair
    # the same run judged against stricter claims than it meets
    strict = dataclasses.replace(sc, min_context_over_hot=1000.0)
    pr = compare_pair(strict, 7, res, hs, "parity")
    assert pr.parity_ok and pr.verdict == "FAIL"
    assert any("hot buffer" in p for p in pr.coverage_problems)
    no_reuse = dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, max_batch=4))
    pr = compare_pair(no_reuse, 7, res, hs, "parity")
    assert any("no state-row reuse" in p for p in pr.coverage_problems)
    roomy = dataclasses.replace(sc, max_device_kv_ratio=0.01)
    pr = compare_pair(roomy, 7, res, hs, "parity")
    assert any("no memory pressure" in p for p in pr.coverage_problems)
    quiet = dataclasses.replace(hs, counters={**hs.counters, "misses": 0})
    pr = compare_pair(sc, 7, res, quiet, "parity")
    assert any("no misses" in p for p in pr.coverage_problems)
    few = dataclasses.replace(hs, counters={**hs.counters, "misses": 10})
    pr = compare_pair(sc, 7, res, few, "parity")
    assert any("no evictions proven" in p for p in pr.coverage_problems)


@pytest.fixture(scope="module")
def hybrid_report(tmp_path_factory):
    """The hybrid CI profile through the CLI: spills and returns forced mid-request."""
    return _cli("hybrid-ci", tmp_path_factory.mktemp("parity") / "hybrid.json")


def test_hybrid_profile_passes_through_spills_and_returns(hybrid_report):
    proc, doc = hybrid_report
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert doc["passed"] is True and doc["identical_token_pct"] == 100.0
    parity = [p for p in doc["pairs"] if p["kind"] == "parity"]
    assert {(p["scenario"], p["seed"]) for p in parity} == {
        (s.name, seed) for s in scenarios("hybrid-ci") for seed in doc["seeds"]
    }
    for p in parity:
        assert p["attention_rows_identical"] == p["attention_rows_total"] > 0, p
        assert p["hidden_identical"] and p["coverage_problems"] == [], p
        c = p["coverage"]
        assert c["spills"] > 0 and c["returns"] > 0 and c["misses"] > 0, p
        assert c["device_kv_ratio"] <= 0.75


def test_hybrid_profile_negative_controls_are_detected(hybrid_report):
    proc, doc = hybrid_report
    controls = [p for p in doc["pairs"] if p["kind"] == "negative-control"]
    assert len(controls) == 2 * len(doc["seeds"]) and doc["negative_control_detected"] is True
    spill = [c for c in controls if "one row too few" in c["note"]]
    assert len(spill) == len(doc["seeds"])
    for c in controls:
        assert c["parity_ok"] is False and c["ok"] is True
        if c in spill:
            assert c["scenario"] == SPILL_CONTROL_SCENARIO and c["coverage"]["spills"] > 0
            assert "never ran" not in c["note"]
        else:
            assert c["scenario"] == NEGATIVE_CONTROL["hybrid-ci"]
            assert "hybrid run refused at bind time" in c["note"]
    assert "hybrid spill off by one): detected" in proc.stdout


def test_a_hybrid_run_without_spills_fails_coverage():
    sc = scenarios("hybrid-ci", ["hybrid-spill-return-g1"])[0]
    roomy = dataclasses.replace(sc.workload, device_blocks=64)  # everything fits
    cks = Checkpoints(CPU)
    try:
        res, hy = run(cks, roomy, 0, "resident"), run(cks, roomy, 0, "hybrid")
    finally:
        cks.close()
    pr = compare_pair(dataclasses.replace(sc, workload=roomy), 0, res, hy, "parity")
    assert pr.parity_ok and pr.verdict == "FAIL"
    assert any("no mid-request spill" in p for p in pr.coverage_problems)
    assert any("no return" in p for p in pr.coverage_problems)
    assert any("no misses" in p for p in pr.coverage_problems)  # the connector never ran


def test_scenarios_are_valid_workloads_in_every_profile():
    for profile in ("full", "ci"):
        got = scenarios(profile)
        assert [s.name for s in got] == [s.name for s in scenarios("ci")]
        for s in got:
            w = s.workload
            assert w.mode == "hisparse" and w.requests > w.max_batch and w.hot_size >= w.top_k
            assert w.longest / w.hot_size >= s.min_context_over_hot
            w.checkpoint_overrides()
    for s in scenarios("full") + scenarios("hybrid") + scenarios("ci") + scenarios("hybrid-ci"):
        w = s.workload  # the top-k selects: every prompt is longer, contexts 4x longer
        assert w.prompt_len * (1 - w.jitter) > w.top_k and w.longest >= 4 * w.top_k
    for s in scenarios("hybrid") + scenarios("hybrid-ci"):
        w = s.workload
        assert w.mode == "hybrid" and s.expect_spills
        assert w.device_blocks < w.max_batch * -(-w.longest // BLOCK)
    assert [s.name for s in scenarios("hybrid")] == [s.name for s in scenarios("hybrid-ci")]
    with pytest.raises(ValueError, match="not in profile"):
        scenarios("ci", ["hybrid-spill-return-g1"])
    with pytest.raises(ValueError, match="unknown scenario"):
        scenarios("ci", ["nope"])
    with pytest.raises(ValueError, match="profile"):
        scenarios("huge")


def test_cli_rejects_bad_arguments(capsys):
    for bad in (["--seeds", "-1"], ["--scenario", "nope"], ["--device", "tpu"]):
        with pytest.raises(SystemExit) as e:
            cli.main(bad)
        assert e.value.code == 2, bad
    with pytest.raises(SystemExit) as e:
        cli.main(["--profile", "ci", "--scenario", "hybrid-g4-bf16"])
    assert e.value.code == 2 and "not in profile" in capsys.readouterr().err
    assert cli.main(["--list", "--profile", "ci"]) == 0
    assert "hot-eq-topk-g4" in capsys.readouterr().out


def test_scenario_filter_still_runs_the_negative_control():
    rep = run_parity(profile="ci", seeds=[3], names=["state-row-reuse"])
    assert [p.kind for p in rep.pairs] == ["parity", "negative-control"]
    assert rep.pairs[1].scenario == NEGATIVE_CONTROL_SCENARIO
    assert rep.passed and rep.negative_control_detected
