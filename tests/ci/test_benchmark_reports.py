"""The report scripts read the benchmark JSON the repo keeps (benchmarks/results): a change of
bench_decode_tpot.py's output that breaks them fails here, not on the next device run."""

from __future__ import annotations

import json
import sys

from tests import REPO_ROOT

RESULTS = REPO_ROOT / "benchmarks" / "results"
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import capacity_report  # noqa: E402
import tpot_report  # noqa: E402


def test_capacity_report_has_a_row_per_context_with_its_ratio():
    run = json.loads((RESULTS / "engine_tpot_h200.json").read_text())
    longer = json.loads(json.dumps(run))
    longer["config"]["ctx_len"] = 131072
    longer["capacity"]["ratio"] = 3.25
    lines = capacity_report.table([longer, run]).splitlines()
    assert len(lines) == 4
    assert lines[2].startswith("| 32768 | 30 |") and f"{run['capacity']['ratio']:.2f}x" in lines[2]
    assert lines[3].startswith("| 131072 |") and "3.25x" in lines[3]


def test_tpot_report_renders_the_kept_results():
    run = json.loads((RESULTS / "engine_tpot_h200.json").read_text())
    md = tpot_report.markdown(run)
    assert "| 112 |" in md and "attention: bmm" in md
