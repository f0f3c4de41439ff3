"""`hisparse bench` takes `--no-progress` as `demo` does, defaults its sweep from the
checkpoint's top-k, and refuses a workload too big for memory in one line naming the flags."""

from __future__ import annotations

import pytest

from hisparse.cli import app as cli
from hisparse.cli import bench
from tests.cli.small import SMALL_FLAGS as BENCH_FLAGS


def test_bench_accepts_no_progress_and_passes_it_to_the_sweep(monkeypatch):
    seen = []

    def sweep(ck, p, prompts, progress=True):
        seen.append((progress, p.hot_sizes))
        return []

    monkeypatch.setattr(bench, "hot_size_sweep", sweep)
    assert cli.main(["bench", *BENCH_FLAGS, "--skip-ops", "--hot-sizes", "16"]) == 0
    assert (
        cli.main(["bench", *BENCH_FLAGS, "--skip-ops", "--hot-sizes", "16", "--no-progress"]) == 0
    )
    assert cli.main(["bench", *BENCH_FLAGS, "--skip-ops", "--top-k", "8"]) == 0
    assert seen == [(True, [16]), (False, [16]), (True, [8, 10, 12, 16, 24, 32])]


def test_a_workload_too_big_is_refused_naming_its_flags(capsys, monkeypatch):
    monkeypatch.setattr(bench, "hot_size_sweep", lambda *a, **k: pytest.fail("no sweep"))
    with pytest.raises(SystemExit) as e:
        cli.main(  # past any machine's memory, not only a small one's: 8 x 1M tokens fit 24 GiB
            ["bench", "--skip-ops", *("--requests", "4096", "--concurrency", "4096"),
             *("--prompt-len", "1000000")]
        )  # fmt: skip
    assert e.value.code == 2
    line = capsys.readouterr().err.strip()
    # bench runs HiSparse only: its host pool (every row) is what does not fit
    assert line.startswith("hisparse bench: error: the hisparse run needs"), line
    assert "--prompt-len + --output-len (1000000 + 32) or --concurrency (4096 running)" in line
