"""`hisparse demo` end to end at a small size: parity, hits, JSON, and the live /metrics endpoint
agreeing with the summary."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import urllib.request

import pytest

from hisparse.cli import app as cli
from hisparse.cli.demo import run_demo, scrape_counters
from tests.devices import needs_cuda
from tests.engine_helpers import SMALL_FLAGS
from tests.helpers import child_timeout


def _args(*extra):
    return cli.build_parser().parse_args(["demo", *SMALL_FLAGS, "--no-progress", *extra])


def test_demo_end_to_end_parity_hits_json_and_metrics(tmp_path, capsys):
    path = tmp_path / "out" / "demo.json"
    rc = cli.main(
        ["demo", *SMALL_FLAGS, "--no-progress", "--metrics-port", "0", "--json", str(path)]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "parity" in out and "OK" in out and "counters match" in out
    s = json.loads(path.read_text())
    assert s["parity"]["ok"] is True
    h, r = s["hisparse"], s["resident"]
    assert h["hits"] > 0 and h["misses"] > 0 and h["host_to_device_bytes"] > 0
    assert r["hits"] == 0 and r["generated_tokens"] == h["generated_tokens"] > 0
    assert 0.5 < h["hit_rate"] < 1.0
    assert 0.0 < h["topk_overlap"] <= 1.0
    assert 0 < h["host_pool_used_bytes"] <= h["host_pool_bytes"]
    me = s["metrics_endpoint"]
    assert me["matches"] is True
    assert me["scraped"] == {k: h[k] for k in ("hits", "misses", "host_to_device_bytes")}


def test_summary_counters_equal_an_independent_scrape():
    from hisparse.connector.exporter import HiSparseMetricsExporter

    exp = HiSparseMetricsExporter(model_name="test")
    port = exp.start(0)
    try:
        outcome = run_demo(_args(), exporter=exp, out=io.StringIO())
        assert outcome.exit_code == 0
        # scrape ourselves, after the run, with plain urllib and our own parsing
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        )
        h = outcome.summary["hisparse"]
        for key, series in (
            ("hits", "vllm:hisparse_cache_hits_total"),
            ("misses", "vllm:hisparse_cache_misses_total"),
            ("host_to_device_bytes", "vllm:hisparse_host_to_device_bytes_total"),
        ):
            lines = [ln for ln in text.splitlines() if ln.startswith(series + "{")]
            assert len(lines) == 1, lines
            assert int(float(lines[0].rsplit(" ", 1)[1])) == h[key] > 0
        assert scrape_counters(port) == {
            k: h[k] for k in ("hits", "misses", "host_to_device_bytes")
        }
    finally:
        exp.stop()


def test_parity_failure_exits_non_zero(capsys):
    rc = cli.main(["demo", *SMALL_FLAGS, "--no-progress", "--binding-fault", "base_offset"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED" in out


def test_console_script_runs(tmp_path):
    # the installed entry point, as a user runs it
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "hisparse",
            "demo",
            *SMALL_FLAGS,
            "--no-progress",
            "--json",
            str(tmp_path / "s.json"),
        ],
        capture_output=True,
        text=True,
        timeout=child_timeout(30),
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert json.loads((tmp_path / "s.json").read_text())["parity"]["ok"] is True


@pytest.mark.cuda
@needs_cuda
def test_demo_cuda_gives_the_same_tokens_as_cpu(tmp_path):
    # the default workload (its prompts repeat tokens: equal indexer scores must be broken the
    # same way on both devices)
    summaries = {}
    for dev in ("cpu", "cuda"):
        args = cli.build_parser().parse_args(["demo", "--no-progress", "--device", dev])
        outcome = run_demo(args, out=io.StringIO())
        assert outcome.exit_code == 0, outcome.summary["parity"]
        summaries[dev] = outcome.summary
    assert summaries["cuda"]["tokens_sha256"] == summaries["cpu"]["tokens_sha256"]
    for k in ("hits", "misses", "host_to_device_bytes", "generated_tokens"):
        assert summaries["cuda"]["hisparse"][k] == summaries["cpu"]["hisparse"][k], k
