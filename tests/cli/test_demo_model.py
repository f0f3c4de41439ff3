"""`hisparse demo`'s checkpoint: `--model DIR` (a DSA checkpoint directory) or the tiny one it
generates (`--arch`, `--layers`, `--index-share`, `--top-k`, `--seed`, `--drift`); the flags that
do not apply, and those of the demo's former engine, refused in one line before any work."""

from __future__ import annotations

import json

import pytest
import torch

from hisparse.cli import app as cli
from hisparse.cli import demo_model
from hisparse.models.dsa.random_checkpoint import random_weights, write_random_checkpoint
from hisparse.models.dsa.weights import read_safetensors
from tests.cli.small import DEMO_FLAGS
from tests.devices import needs_cuda


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("dsa") / "glm", "glm_moe_dsa", seed=3)


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_demo_model_runs_the_checkpoint_in_every_mode(glm, tmp_path, capsys):
    out = tmp_path / "s.json"
    argv = ["demo", "--model", str(glm), "--prompts", "3", "--new-tokens", "12"]
    assert cli.main([*argv, "--device-blocks", "8", "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"model: {glm} (glm_moe_dsa): 4 layers in 2 index groups, top-k 16" in text
    assert "OK: tokens identical in 3/3 requests (resident, hisparse, hybrid)" in text, text
    s = json.loads(out.read_text())
    assert s["model"]["directory"] == str(glm) and s["model"]["seed"] is None
    assert s["workload"]["device_blocks"] == 8
    assert s["hybrid"]["counters"]["spilled_requests"] >= 1, s["hybrid"]
    assert s["tokens"]["hybrid"] == s["tokens"]["resident"]
    assert [len(t) for t in s["tokens"]["hisparse"]] == [12] * 3


def test_demo_model_refuses_a_bad_directory_in_one_line(tmp_path, capsys):
    line = _error(capsys, ["demo", "--model", str(tmp_path)])
    assert line == (
        f"hisparse demo: error: --model {tmp_path}: no config.json (not a checkpoint directory)"
    )


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--top-k", "8"], "argument --top-k: shapes the generated checkpoint; --model "),
        (["--drift", "0.5"], "argument --drift: shapes the generated checkpoint"),
        (["--hot-size", "8"], "argument --hot-size: must be >= the checkpoint's index_topk (16)"),
        (
            ["--prompt-len", "600"],
            "requests of up to 669 tokens (--prompt-len 600 + 21 + --output-len 48) exceed the 512",
        ),
    ],
)
def test_demo_model_refuses_flags_that_do_not_fit_it(glm, capsys, extra, words):
    line = _error(capsys, ["demo", "--model", str(glm), *extra])
    assert line.startswith("hisparse demo: error: ") and words in line, line


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--binding-fault", "base_offset"], "argument --binding-fault: no longer taken"),
        (["--recent-window", "4"], "argument --recent-window: no longer taken"),
        (["--metrics-interval", "5"], "argument --metrics-interval: no longer taken"),
        (["--arch", "deepseek_v32", "--index-share", "2"], "argument --index-share: DeepSeek"),
        (["--layers", "2", "--index-share", "3"], "argument --index-share: must be <= --layers"),
        (["--top-k", "16", "--hot-size", "8"], "argument --hot-size: must be >= --top-k (16)"),
    ],
)
def test_flags_that_no_longer_apply_are_one_line(capsys, monkeypatch, argv, words):
    monkeypatch.setattr(demo_model, "load", lambda *a: pytest.fail("no checkpoint before checks"))
    line = _error(capsys, ["demo", *argv])
    assert line.startswith("hisparse demo: error: ") and words in line, line


def test_the_generated_deepseek_checkpoint_runs_every_indexer(capsys):
    assert cli.main(["demo", *DEMO_FLAGS, "--arch", "deepseek_v32", "--layers", "3"]) == 0
    out = capsys.readouterr().out
    assert "(deepseek_v32, seed 0, drift 0.1), generated: 3 layers in 3 index groups" in out
    assert "OK: tokens identical in 5/5 requests" in out


@pytest.mark.parametrize("drift", [0.0, 0.3, 1.0])
def test_drift_mixes_one_shared_vector_into_the_embeddings(tmp_path, drift):
    args = cli.build_parser().parse_args(["demo", "--layers", "2", "--drift", str(drift)])
    choice = demo_model.choose(args, 128)
    d = demo_model.write_checkpoint(tmp_path, choice)
    embed = read_safetensors(d / "model.safetensors", torch.device("cpu"))[
        "model.embed_tokens.weight"
    ]
    own = random_weights(choice.hf, 0)["model.embed_tokens.weight"]
    shared = (embed - drift**0.5 * own) / (1 - drift) ** 0.5 if drift < 1 else None
    if shared is None:
        assert torch.equal(embed, own)
    else:  # every row is the same shared vector plus its own part
        assert torch.allclose(shared, shared[:1].expand_as(shared), atol=1e-5)
        assert shared[0].norm() > 0.5 * own[0].norm()


@pytest.mark.cuda
@needs_cuda
def test_demo_model_on_cuda(glm, capsys):
    argv = ["demo", "--model", str(glm), "--device", "cuda", "--prompts", "2", "--new-tokens", "8"]
    assert cli.main([*argv, "--no-progress"]) == 0
    assert "OK: tokens identical in 2/2 requests" in capsys.readouterr().out
