"""`hisparse export-model` in the environment README command (a) makes: no numpy needed, numpy
declared (so torch prints no "Failed to initialize NumPy"), and a failed export leaves nothing
behind (issue 23, item 7)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tomllib

from hisparse.models import checkpoint
from hisparse.models.checkpoint import export_model, model_config
from tests import REPO_ROOT

ARGS = ["--layers", "2", "--top-k", "8", "--max-model-len", "64"]


def _small():
    return model_config(64, num_layers=2, index_share=2, top_k=8, hidden=32, vocab=300, seed=3)


def test_export_model_runs_without_numpy_and_writes_the_same_bytes(tmp_path):
    # numpy made unimportable, as in an environment with torch alone.
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "from hisparse.cli import main\n"
        f"sys.exit(main(['export-model', sys.argv[1], *{ARGS!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "nonp")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Numpy is not available" not in r.stderr
    export_model(tmp_path / "ref", model_config(64, num_layers=2, top_k=8))
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (tmp_path / "nonp" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_numpy_is_a_declared_dependency():
    """torch warns "Failed to initialize NumPy" on every import where numpy is missing; README
    command (a) installs hisparse's dependencies only, so numpy must be one of them."""
    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps), deps


def _fail_writing_weights(monkeypatch):
    def broken(path, tensors):
        with open(path, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_safetensors", broken)


@pytest.mark.parametrize("nested", [False, True])
def test_a_failed_export_leaves_nothing_behind(tmp_path, monkeypatch, nested):
    _fail_writing_weights(monkeypatch)
    out = tmp_path / "a" / "b" / "m" if nested else tmp_path / "m"
    with pytest.raises(OSError, match="No space left"):
        export_model(out, _small())
    assert list(tmp_path.iterdir()) == []  # no DIR, no parents made for it, no temporary


def test_a_failed_export_into_an_existing_directory_changes_nothing(tmp_path, monkeypatch):
    out = export_model(tmp_path / "m", _small())
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _fail_writing_weights(monkeypatch)
    with pytest.raises(OSError):
        export_model(out, model_config(64, num_layers=3, top_k=8))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_an_export_replaces_an_existing_one_and_keeps_other_files(tmp_path):
    out = export_model(tmp_path / "m", _small())
    (out / "notes.txt").write_text("mine")
    export_model(out, model_config(64, num_layers=3, top_k=8))
    assert (out / "notes.txt").read_text() == "mine"
    assert '"num_hidden_layers": 3' in (out / "config.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
