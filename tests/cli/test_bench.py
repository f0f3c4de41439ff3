"""`hisparse bench` (which op benchmark ran and its table on screen; the hit-rate sweep on the
DSA engine, its table on screen, plot and JSON) and the headline benchmark's small CPU mode."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from hisparse.cli import app as cli
from hisparse.cli import bench
from hisparse.engine.dsa import generate as gen
from tests import REPO_ROOT
from tests.cli.small import SMALL_FLAGS

ROOT = REPO_ROOT
BENCH_FLAGS = SMALL_FLAGS


def _bench_ops_only(tmp_path, monkeypatch) -> dict:
    """`hisparse bench` with the sweep stubbed out (the op part is under test); its JSON."""
    monkeypatch.setattr(bench, "hot_size_sweep", lambda *a, **k: [])
    js = tmp_path / "bench.json"
    args = ["bench", *BENCH_FLAGS, "--op-reps", "1", "--hot-sizes", "16", "--json", str(js)]
    assert cli.main(args) == 0
    return json.loads(js.read_text())["ops"]


def test_bench_in_a_checkout_runs_bench_ops_and_shows_its_table(tmp_path, capsys, monkeypatch):
    """The CLI moved into hisparse/cli/ once and looked for benchmarks/ inside hisparse/: the
    subset ran in the checkout too, and only --json saw its figures."""
    assert bench.BENCH_OPS == ROOT / "benchmarks" / "bench_ops.py"
    ops = _bench_ops_only(tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert ops["source"] == "benchmarks/bench_ops.py"
    assert f"op micro-benchmarks (cpu): {bench.BENCH_OPS}" in out and bench.BUILTIN not in out
    assert {r["op"] for r in ops["rows"]} == {"resolve", "gather"}
    assert "\n".join(bench.ops_table(ops["rows"])) in out


def test_bench_without_the_repository_says_it_runs_the_subset(tmp_path, capsys, monkeypatch):
    """An installed package has no benchmarks/ beside it: the screen says the subset ran."""
    monkeypatch.setattr(bench, "BENCH_OPS", tmp_path / "benchmarks" / "bench_ops.py")
    ops = _bench_ops_only(tmp_path, monkeypatch)
    out = capsys.readouterr().out
    assert ops["source"] == bench.BUILTIN
    assert f"op micro-benchmarks (cpu): the {bench.BUILTIN}" in out and "source checkout" in out
    assert sorted((r["op"], r["batch"]) for r in ops["rows"]) == [
        ("gather", 1),
        ("gather", 8),
        ("resolve", 1),
        ("resolve", 8),
    ]
    table = bench.ops_table(ops["rows"])
    assert len(table) == 5 and "\n".join(table) in out


def test_bench_refuses_a_bench_ops_that_does_not_load(tmp_path, capsys, monkeypatch):
    broken = tmp_path / "benchmarks" / "bench_ops.py"
    broken.parent.mkdir()
    broken.write_text("import no_such_module_here\n")
    monkeypatch.setattr(bench, "BENCH_OPS", broken)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *BENCH_FLAGS, "--hot-sizes", "16"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert f"{broken} does not load" in err and "no_such_module_here" in err


def test_bench_sweep_on_the_dsa_engine_shows_its_table_plot_and_json(tmp_path, capsys):
    png, js = tmp_path / "sweep.png", tmp_path / "sweep.json"
    argv = ["bench", *BENCH_FLAGS, "--skip-ops", "--hot-sizes", "16,24,64"]
    assert cli.main([*argv, "--plot", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    res = json.loads(js.read_text())
    sweep = res["sweep"]
    assert [r["hot_size"] for r in sweep] == [16, 24, 64]
    assert res["workload"]["model"]["arch"] == "glm_moe_dsa" and res["tokens_identical"] is True
    # what ran and its results are on the screen, not only in the JSON
    assert "hit rate vs hot-buffer size (DSA engine, HiSparse mode)" in out
    assert "model: a tiny GLM-5 checkpoint (glm_moe_dsa, seed 0, drift 0.1), generated" in out
    assert "\n".join(bench.sweep_table(sweep)) in out
    assert "generated tokens: identical at every hot size" in out
    # the tokens, hence the selections, do not depend on the hot size; a bigger hot buffer
    # misses less (deterministic, so this is not flaky) and holds more device rows
    assert len({r["tokens_sha256"] for r in sweep}) == 1
    misses = [r["misses"] for r in sweep]
    assert misses[0] > misses[1] >= misses[2] > 0, misses
    assert all(0 < r["hit_rate"] < 1 for r in sweep)
    assert [r["device_kv_bytes"] for r in sweep] == [3 * h * 2 * 656 for h in (16, 24, 64)]


def test_bench_fails_when_the_hot_size_changes_the_tokens(capsys, monkeypatch):
    real = gen.generate

    def tampered(ck, mode, rf, dev, prompts, new, hot_size, **k):
        g = real(ck, mode, rf, dev, prompts, new, hot_size, **k)
        if hot_size == 24:
            g.tokens[1][0] += 1
        return g

    monkeypatch.setattr(gen, "generate", tampered)
    assert cli.main(["bench", *BENCH_FLAGS, "--skip-ops", "--hot-sizes", "16,24"]) == 1
    assert "FAILED: the generated tokens differ between hot sizes" in capsys.readouterr().out


def _bench_engine():
    spec = importlib.util.spec_from_file_location(
        "bench_engine", ROOT / "benchmarks" / "bench_engine.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_engine_small_mode(tmp_path):
    """The headline benchmark's --small CPU run on the DSA engine: resident fits 2 requests but
    not 8, HiSparse both; every run's device bytes match the budget's accounting (the script
    asserts it), tokens agree at every level, the ratios against resident are finite."""
    args = ["--device", "cpu", "--small", "--concurrency", "2,8", "--repeats", "2"]
    out = ["--out-dir", str(tmp_path), "--name", "t", "--commit", "abc1234"]
    assert _bench_engine().main([*args, *out]) == 0
    res = json.loads((tmp_path / "t.json").read_text())
    assert res["engine"] == "hisparse.engine.dsa" and res["config"]["row_format"] == "fp8"
    assert res["env"]["commit"] == "abc1234"  # as given: a device copy's git names an older one
    cap = res["capacity"]
    assert 2 <= cap["resident"] < 8 <= cap["hisparse"] and cap["hybrid"] >= 8
    ok = [r for r in res["rows"] if r["status"] == "ok"]
    assert sorted({(r["mode"], r["concurrency"]) for r in ok}) == [
        ("hisparse", 2), ("hisparse", 8), ("hybrid", 2), ("hybrid", 8), ("resident", 2),
    ]  # fmt: skip
    assert [
        r["status"] for r in res["rows"] if r["mode"] == "resident" and r["concurrency"] == 8
    ] == ["out of memory"]
    assert len(ok) == 10 and {r["execution"] for r in ok} == {"eager"}  # no CUDA graphs on a CPU
    for r in ok:
        assert r["decode_tokens_per_s"] > 0 and r["device_bytes"] <= res["budget_bytes"]
    hy8 = [r for r in ok if r["mode"] == "hybrid" and r["concurrency"] == 8]
    assert all(r["peak_spilled"] > 0 for r in hy8)  # past resident's capacity hybrid spills
    assert res["parity"] == {"2": True, "8": True}
    rat = res["ratios"]
    assert rat["2"]["hybrid/resident"]["against"] == "same level"
    assert rat["8"]["hybrid/resident"]["against"] == "resident's best"
    for level in rat.values():
        for v in level.values():
            assert math.isfinite(v["median"]) and v["median"] > 0, v
    md = (tmp_path / "t.md").read_text()
    assert md.startswith("# DSA engine: decode throughput") and "Hybrid ÷ resident where" in md
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_bench_engine_parity_fails_a_run_whose_tokens_differ(tmp_path, monkeypatch):
    """A mode subset writes its table with the other modes marked not run; a hybrid run whose
    tokens differ from resident's fails the level's parity and the exit status."""
    mod = _bench_engine()
    real = mod.gen.generate

    def tampered(ck, mode, *a, **k):
        g = real(ck, mode, *a, **k)
        if mode == "hybrid":
            g.tokens[0][-1] += 1
        return g

    monkeypatch.setattr(mod.gen, "generate", tampered)
    args = ["--device", "cpu", "--small", "--concurrency", "1", "--repeats", "1"]
    rc = mod.main([*args, "--modes", "resident,hybrid", "--out-dir", str(tmp_path), "--name", "s"])
    assert rc == 1
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["parity"] == {"1": False}
    md = (tmp_path / "s.md").read_text()
    row = next(line for line in md.splitlines() if line.startswith("| 1 |"))  # the main table
    assert "not run" in row and row.endswith("| FAILED |"), row
