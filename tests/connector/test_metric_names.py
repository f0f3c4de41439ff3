"""Metric names in README, docs, dashboard and source must be exactly the ones the code exports.

Upstream the change description and the code disagreed on the names; here they cannot."""

from __future__ import annotations

import json
import re

from hisparse.connector.exporter import HiSparseMetricsExporter
from hisparse.connector.stats import METRIC_NAMES
from tests import REPO_ROOT

ROOT = REPO_ROOT
_NAME = re.compile(r"vllm:hisparse_[A-Za-z0-9_]+")
_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum")


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def names_in(text: str) -> set:
    return {_base(n) for n in _NAME.findall(text)}


def exported_names() -> set:
    """What a scrape actually shows (suffixes stripped), not just the constants."""
    text = HiSparseMetricsExporter().render().decode()
    return {_base(n) for n in _NAME.findall(text)}


def unknown_names(text: str) -> set:
    return names_in(text) - exported_names()


def _docs():
    files = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "dashboards").glob("*.json")),
    ]
    return [p for p in files if p.exists()]


def test_exported_names_match_the_constants():
    assert exported_names() == set(METRIC_NAMES)


def test_docs_readme_and_dashboard_name_only_exported_metrics():
    bad = {str(p.relative_to(ROOT)): sorted(unknown_names(p.read_text())) for p in _docs()}
    assert not {k: v for k, v in bad.items() if v}, f"names the code does not export: {bad}"


def test_source_names_only_exported_metrics():
    src = {
        str(p.relative_to(ROOT)): sorted(unknown_names(p.read_text()))
        for p in (ROOT / "hisparse").rglob("*.py")
    }
    assert not {k: v for k, v in src.items() if v}


def test_every_exported_metric_is_documented_and_on_the_dashboard():
    telemetry = (ROOT / "docs" / "telemetry.md").read_text()
    readme = (ROOT / "README.md").read_text()
    dash = json.loads((ROOT / "dashboards" / "hisparse.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for name in exported_names():
        assert name in names_in(telemetry), f"{name} missing from docs/telemetry.md"
        assert name in names_in(readme), f"{name} missing from the README's metric table"
        assert name in names_in(exprs), f"{name} missing from the dashboard's queries"


def test_dashboard_counters_are_queried_with_the_total_suffix():
    dash = json.loads((ROOT / "dashboards" / "hisparse.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for full in _NAME.findall(exprs):
        if _base(full) in {
            "vllm:hisparse_cache_hits",
            "vllm:hisparse_cache_misses",
            "vllm:hisparse_host_to_device_bytes",
        }:
            assert full.endswith("_total"), f"counter queried without _total: {full}"


def test_the_check_catches_the_upstream_drift():
    # The upstream description's names: the check must flag them.
    text = (
        "scrape vllm:hisparse_hits and vllm:hisparse_lookups_total and "
        "vllm:hisparse_cache_hits_total"
    )
    assert unknown_names(text) == {"vllm:hisparse_hits", "vllm:hisparse_lookups"}
