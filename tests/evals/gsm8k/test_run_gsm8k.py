"""evals/gsm8k/run_gsm8k.py: the command line's exit codes and JSON against a running server."""

from __future__ import annotations

import json
import os

import yaml

from evals.gsm8k import run_gsm8k
from evals.gsm8k.fake_server import FakeOpenAIServer
from tests.evals.gsm8k.builders import (
    CONFIGS,
    canned_answers,
    good_dict,
    make_dataset,
    write_data,
)


def test_cli_against_base_url_exit_codes_and_json(tmp_path):
    test, train = make_dataset(10, 2)
    data = write_data(tmp_path, test, train)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(
        yaml.safe_dump(good_dict(num_questions=10, num_fewshot=2, accuracy_threshold=0.9))
    )
    out = tmp_path / "res.json"
    common = [
        "--config",
        str(cfg_path),
        "--data-dir",
        data,
        "--log-dir",
        str(tmp_path / "logs"),
        "--json",
        str(out),
        "--quiet",
    ]
    with FakeOpenAIServer("fake/model", canned_answers(test, 9, style="answer_is")) as srv:
        assert run_gsm8k.main(common + ["--base-url", srv.base_url + "/v1"]) == 0
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["results"][0]["correct"] == 9
    with FakeOpenAIServer("fake/model", canned_answers(test, 8)) as srv:
        assert run_gsm8k.main(common + ["--base-url", srv.base_url]) == 1
    doc = json.loads(out.read_text())
    assert not doc["passed"] and doc["results"][0]["accuracy"] == 0.8
    # a smoke run with fewer questions keeps the floor
    with FakeOpenAIServer("fake/model", canned_answers(test, 8)) as srv:
        assert run_gsm8k.main(common + ["--base-url", srv.base_url, "--num-questions", "5"]) == 0


def test_cli_config_errors_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(good_dict(max_concurrency="32")))
    assert run_gsm8k.main(["--config", str(bad), "--validate-only"]) == 2
    assert "key 'max_concurrency' must be int" in capsys.readouterr().err
    assert (
        run_gsm8k.main(
            ["--config-list", os.path.join(CONFIGS, "models-hisparse.txt"), "--validate-only"]
        )
        == 0
    )
