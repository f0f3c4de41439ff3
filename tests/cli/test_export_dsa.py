"""`hisparse export-model --arch deepseek_v32 / glm_moe_dsa`: a seeded tiny checkpoint of a real
architecture, written without transformers, that hisparse's DSA config reader and weight loader
take; replaced whole on a second export; the flags and --arch of the retired sparse-MLA export
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from hisparse.cli.app import main
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.random_checkpoint import EXPORT_MARK
from hisparse.models.dsa.weights import load_checkpoint


@pytest.mark.parametrize("arch", ["deepseek_v32", "glm_moe_dsa"])
def test_writes_a_checkpoint_the_dsa_classes_read(arch, tmp_path, capsys):
    out = tmp_path / arch
    argv = ["export-model", str(out), "--arch", arch, "--layers", "3", "--top-k", "32"]
    assert main(argv + ["--max-model-len", "1024", "--seed", "5"]) == 0
    assert "--hf-overrides" in capsys.readouterr().out
    hf = json.loads((out / "config.json").read_text())
    cfg = DSAConfig.from_hf(hf)
    assert (cfg.arch, cfg.num_layers, cfg.index_topk) == (arch, 3, 32)
    assert hf[EXPORT_MARK] == 5 and hf["max_position_embeddings"] == 1024
    if arch == "glm_moe_dsa":
        assert hf["indexer_types"] == ["full", "shared", "full"]
    first = load_checkpoint(out, torch.device("cpu"))
    assert first.cfg == cfg and len(first.attn) == 3
    assert main(argv + ["--max-model-len", "1024", "--seed", "5"]) == 0  # an earlier export
    again = load_checkpoint(out, torch.device("cpu"))  # replaced whole: the same seeded draw
    assert torch.equal(first.embed, again.embed) and torch.equal(first.lm_head, again.lm_head)


@pytest.mark.parametrize(
    "extra,says",
    [
        (["--hidden", "128"], "unrecognized arguments: --hidden 128"),
        (["--row-format", "bf16"], "unrecognized arguments: --row-format bf16"),
        (["--arch", "reference"], "argument --arch: invalid choice: 'reference'"),
        (["--top-k", "4096", "--max-model-len", "1024"], "argument --top-k: must be <="),
    ],
)
def test_retired_flags_and_bad_sizes_are_refused_in_one_line(extra, says, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export-model", str(tmp_path / "m"), "--arch", "deepseek_v32", *extra])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "m").exists()


def test_a_foreign_directory_is_kept_unless_forced(tmp_path, capsys):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit):
        main(["export-model", str(d), "--arch", "glm_moe_dsa"])
    assert "pass --force" in capsys.readouterr().err and (d / "notes.txt").exists()


def test_a_longer_context_stretches_the_yarn_rope_so_vllm_can_serve_it(tmp_path):
    """vLLM tabulates DeepSeek's YaRN rope for original_max_position_embeddings x factor positions;
    an export with a longer context stretches the factor to cover it, and a config that does not
    is refused for a longer context by name."""
    out = tmp_path / "dsv"
    assert (
        main(["export-model", str(out), "--arch", "deepseek_v32", "--max-model-len", "2048"]) == 0
    )
    cfg = DSAConfig.from_hf(json.loads((out / "config.json").read_text()))
    assert cfg.rope_positions() == 2048
    cfg.check_context(2048, "--max-model-len")
    with pytest.raises(
        ValueError,
        match=r"--max-model-len 4096 exceeds the 2048 positions .*"
        r"use --max-model-len 2048 or less",
    ):
        cfg.check_context(4096, "--max-model-len")
    glm = tmp_path / "glm"
    assert main(["export-model", str(glm), "--arch", "glm_moe_dsa"]) == 0
    assert DSAConfig.from_hf(json.loads((glm / "config.json").read_text())).rope_positions() is None


def test_without_arch_it_writes_deepseek_v32(tmp_path, capsys):
    """The default architecture is DeepSeek-V3.2."""
    out = tmp_path / "default"
    assert main(["export-model", str(out), "--layers", "2", "--top-k", "16"]) == 0
    assert "HiSparseDeepseekV32ForCausalLM" in capsys.readouterr().out
    hf = json.loads((out / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV32ForCausalLM"]
    assert DSAConfig.from_hf(hf).arch == "deepseek_v32"
