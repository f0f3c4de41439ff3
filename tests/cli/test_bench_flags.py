"""`hisparse bench` takes `--no-progress` as `demo` does, and a product of two flags that
overflows int32 is reported against both flags, not as `argument --concurrency: * hot_size`
(issue 23, item 10)."""

from __future__ import annotations

import pytest

from hisparse.cli import app as cli
from hisparse.cli import bench
from tests.engine_helpers import SMALL_FLAGS

BENCH_FLAGS = [f for f in SMALL_FLAGS if f not in ("--hot-size", "32")]


def test_bench_accepts_no_progress_and_passes_it_to_the_sweep(monkeypatch):
    seen = []

    def sweep(cfg, hot_sizes, device, progress=True):
        seen.append(progress)
        return []

    monkeypatch.setattr(bench, "hot_size_sweep", sweep)
    assert cli.main(["bench", *BENCH_FLAGS, "--skip-ops", "--hot-sizes", "16"]) == 0
    assert (
        cli.main(["bench", *BENCH_FLAGS, "--skip-ops", "--hot-sizes", "16", "--no-progress"]) == 0
    )
    assert seen == [True, False]


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["demo", "--concurrency", "65536", "--top-k", "32", "--hot-size", "32768"],
            "argument --concurrency: --concurrency * --hot-size must fit int32 rows",
        ),
        (
            ["bench", "--concurrency", "65536", "--top-k", "32", "--hot-sizes", "64,32768"],
            "argument --concurrency: --concurrency * --hot-sizes must fit int32 rows",
        ),
        (
            ["demo", "--concurrency", "65536", "--prompt-len", "40000", "--output-len", "1"],
            "argument --concurrency: --concurrency * (--prompt-len + --output-len) must fit int32",
        ),
    ],
)
def test_an_overflowing_product_names_both_flags(capsys, argv, expected):
    line = _error(capsys, [*argv, "--prompt-len", "8"] if "--prompt-len" not in argv else argv)
    assert expected in line, line
    assert "* hot_size" not in line and ": *" not in line
