"""`hisparse export-model` (a tiny seeded DeepSeek-V3.2 / GLM-5 checkpoint) in the environment
README command (a) makes: no numpy needed, numpy declared (so torch prints no "Failed to
initialize NumPy"), and a failed export leaves nothing behind (issue 23, item 7). An export
replaces an earlier one whole (no stale index or shards beside it), refuses someone else's
directory unless forced, makes files and directory with the umask's modes, and refuses flags that
cannot go together in one line before any work."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
import tomllib

from hisparse.cli import main
from hisparse.models import export_dir
from hisparse.models.dsa import random_checkpoint
from hisparse.models.dsa.random_checkpoint import export_random_checkpoint
from hisparse.models.export_dir import EXPORT_FILES, ExportError
from tests import REPO_ROOT
from tests.helpers import child_timeout

ARGS = ["--arch", "deepseek_v32", "--layers", "2", "--top-k", "8", "--max-model-len", "64"]


def export_model(out, layers: int = 2, *, force: bool = False, arch: str = "deepseek_v32"):
    """What ``ARGS`` asks for (``layers`` aside), as the command calls it."""
    return export_random_checkpoint(
        out,
        arch,
        force=force,
        num_hidden_layers=layers,
        index_topk=8,
        max_position_embeddings=64,
    )


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
        timeout=child_timeout(10),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Numpy is not available" not in r.stderr
    export_model(tmp_path / "ref")
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

    monkeypatch.setattr(random_checkpoint, "write_safetensors", broken)


@pytest.mark.parametrize("nested", [False, True])
def test_a_failed_export_leaves_nothing_behind(tmp_path, monkeypatch, nested):
    _fail_writing_weights(monkeypatch)
    out = tmp_path / "a" / "b" / "m" if nested else tmp_path / "m"
    with pytest.raises(OSError, match="No space left"):
        export_model(out)
    assert list(tmp_path.iterdir()) == []  # no DIR, no parents made for it, no temporary


def test_a_failed_export_into_an_existing_directory_changes_nothing(tmp_path, monkeypatch):
    out = export_model(tmp_path / "m")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    _fail_writing_weights(monkeypatch)
    with pytest.raises(OSError):
        export_model(out, 3)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_an_export_replaces_an_earlier_one_whole(tmp_path):
    out = export_model(tmp_path / "m")
    export_model(out, 3)
    assert '"num_hidden_layers": 3' in (out / "config.json").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(EXPORT_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary, no old copy


def _sharded_checkpoint(d):
    """What a loader following the index would load: shards beside an index, a foreign config."""
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    for i in (1, 2):
        (d / f"model-0000{i}-of-00002.safetensors").write_bytes(b"old")
    return {p.name: p.read_bytes() for p in d.iterdir()}


def test_a_foreign_directory_is_refused_and_left_as_it_was(tmp_path):
    before = _sharded_checkpoint(tmp_path / "m")
    with pytest.raises(ExportError, match=r"is not empty and is not an earlier export") as e:
        export_model(tmp_path / "m")
    assert "(it holds 'model-00001-of-00002.safetensors', which an export" in str(e.value)
    assert "--force" in str(e.value) and "\n" not in str(e.value)
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


@pytest.mark.parametrize(
    "extra", ["notes.txt", "model.safetensors.index.json", "model-00001-of-00002.safetensors"]
)
def test_an_earlier_export_with_files_beside_it_is_not_an_export(tmp_path, extra):
    out = export_model(tmp_path / "m")
    (out / extra).write_text("mine")
    with pytest.raises(ExportError, match=rf"\(it holds {extra!r}, which an export does not"):
        export_model(out)
    assert (out / extra).read_text() == "mine"


@pytest.mark.parametrize(
    "config, why",
    [
        (None, "it has no config.json"),
        ("{not json", "its config.json does not read as JSON"),
        ('{"architectures": ["LlamaForCausalLM"]}', "its config.json is not an export's"),
    ],
)
def test_a_directory_of_export_file_names_alone_is_not_an_export(tmp_path, config, why):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"someone's")
    if config is not None:
        (tmp_path / "m" / "config.json").write_text(config)
    with pytest.raises(ExportError, match=rf"\({why}\); pass --force"):
        export_model(tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == b"someone's"


def test_force_replaces_a_foreign_directory_leaving_no_stale_index_or_shards(tmp_path):
    _sharded_checkpoint(tmp_path / "m")
    out = export_model(tmp_path / "m", force=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(EXPORT_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_replacement_without_an_atomic_exchange(tmp_path, monkeypatch):
    """Where renameat2 cannot exchange (another OS or filesystem), two renames do it."""
    monkeypatch.setattr(export_dir, "_exchange", lambda a, b: False)
    _sharded_checkpoint(tmp_path / "m")
    out = export_model(tmp_path / "m", force=True)
    assert sorted(p.name for p in out.iterdir()) == sorted(EXPORT_FILES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_a_link_to_an_export_stays_a_link(tmp_path):
    real = export_model(tmp_path / "real")
    (tmp_path / "link").symlink_to(real)
    export_model(tmp_path / "link", 3)
    assert (tmp_path / "link").is_symlink()
    assert '"num_hidden_layers": 3' in (real / "config.json").read_text()


def test_cli_force(tmp_path, capsys):
    _sharded_checkpoint(tmp_path / "m")
    with pytest.raises(SystemExit) as e:
        main(["export-model", str(tmp_path / "m"), *ARGS])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith("pass --force to replace it whole"), err
    assert main(["export-model", str(tmp_path / "m"), *ARGS, "--force"]) == 0
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(EXPORT_FILES)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
@pytest.mark.parametrize("existing", [False, True])
def test_modes_follow_the_umask(tmp_path, umask, existing):
    out = tmp_path / "m"
    if existing:
        export_model(out)
    old = os.umask(umask)
    try:
        export_model(out)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    for p in out.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, p.name


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--top-k", "4096", "--max-model-len", "2048"],
            "argument --top-k: must be <= --max-model-len (2048), got 4096",
        ),
        (["--layers", "0"], "argument --layers: must be >= 1, got 0"),
        (["--arch", "reference"], "argument --arch: invalid choice: 'reference'"),
        (["--hidden", "64"], "unrecognized arguments: --hidden 64"),
    ],
)
def test_flags_that_cannot_go_together_are_one_line_before_any_work(
    tmp_path, capsys, monkeypatch, flags, message
):
    monkeypatch.setattr(random_checkpoint, "random_weights", _never)
    with pytest.raises(SystemExit) as e:
        main(["export-model", str(tmp_path / "m"), *flags])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert list(tmp_path.iterdir()) == []


def _never(hf, seed=0):
    raise AssertionError("weights drawn for flags that were to be refused")


def test_a_dir_that_is_a_file_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(SystemExit) as e:
        main(["export-model", str(tmp_path / "f"), *ARGS])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "not a directory" in err, err
    assert (tmp_path / "f").read_text() == "mine"
