"""The GSM8K harness without a model, a GPU or the network: config schema, answer extraction,
prompts, the pass/fail rule, and full runs against a fake OpenAI-compatible server."""

from __future__ import annotations

import ast
import copy
import json
import os
import sys
import time

import pytest
import yaml

from tests import REPO_ROOT

REPO = str(REPO_ROOT)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from evals.gsm8k import run_gsm8k  # noqa: E402
from evals.gsm8k.answers import extract_answer, extract_reference, is_correct, normalize_number  # noqa: E402
from evals.gsm8k.config import SCHEMA, ConfigError, load_config, read_model_list, validate  # noqa: E402
from evals.gsm8k.dataset import DatasetError, Example, load_split  # noqa: E402
from evals.gsm8k.fake_server import FakeOpenAIServer  # noqa: E402
from evals.gsm8k.harness import evaluate, passes, run_config  # noqa: E402
from evals.gsm8k.prompts import STOP, build_prompt  # noqa: E402

CONFIGS = os.path.join(REPO, "evals", "gsm8k", "configs")
GLM = os.path.join(CONFIGS, "GLM-5.2-NVFP4-HiSparse.yaml")
DSV = os.path.join(CONFIGS, "DeepSeek-V3.2-HiSparse.yaml")
FAKE_SERVER = os.path.join(REPO, "evals", "gsm8k", "fake_server.py")


def good_dict(**over):
    d = {
        "model_name": "fake/model",
        "accuracy_threshold": 0.5,
        "tolerance": 0.0,
        "num_questions": 10,
        "num_fewshot": 2,
        "max_tokens": 64,
        "max_concurrency": 4,
        "request_timeout_seconds": 10,
        "startup_max_wait_seconds": 10,
        "server_args": "--max-model-len 2048",
    }
    d.update(over)
    return d


# ----------------------------------------------------------------------------- shipped configs


def test_glm_config_has_exactly_the_issue_values():
    cfg = load_config(GLM)
    assert cfg.model_name == "nvidia/GLM-5.2-NVFP4"
    assert (cfg.accuracy_threshold, cfg.tolerance) == (0.90, 0.0)
    assert (cfg.num_questions, cfg.num_fewshot, cfg.max_tokens) == (1319, 5, 256)
    assert cfg.max_concurrency == 32
    assert cfg.request_timeout_seconds == 1800
    assert cfg.startup_max_wait_seconds == 1200
    assert cfg.server_option("--tensor-parallel-size") == "4"
    assert cfg.server_option("--max-model-len") == "8192"
    assert cfg.server_option("--max-num-seqs") == "32"
    assert cfg.server_option("--max-num-batched-tokens") == "4096"
    assert cfg.server_option("--enforce-eager") == ""
    assert cfg.server_option("--kv-cache-dtype") == "bfloat16"
    assert cfg.kv_transfer_config() == {
        "kv_connector": "HiSparseOOTConnector",
        "kv_connector_module_path": "hisparse.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"host_pool_gib": 32},
    }
    assert cfg.gpus_needed() == 4


def test_deepseek_config_loads_and_uses_the_connector():
    cfg = load_config(DSV)
    assert cfg.model_name == "deepseek-ai/DeepSeek-V3.2"
    assert cfg.num_questions == 1319 and cfg.num_fewshot == 5
    kv = cfg.kv_transfer_config()
    assert kv["kv_connector"] == "HiSparseOOTConnector"
    assert kv["kv_connector_module_path"] == "hisparse.connector"
    assert kv["kv_role"] == "kv_both"


def test_model_list_names_both_configs():
    listed = read_model_list(os.path.join(CONFIGS, "models-hisparse.txt"))
    assert [os.path.basename(p) for p in listed] == [os.path.basename(GLM), os.path.basename(DSV)]


@pytest.mark.parametrize("path", [GLM, DSV])
def test_config_connector_resolves_to_a_class_in_this_repo(path):
    """vLLM imports kv_connector_module_path and looks up kv_connector in it. Check, without
    importing vLLM, that the module file exists and defines that class: a rename breaks this."""
    kv = load_config(path).kv_transfer_config()
    mod_file = os.path.join(REPO, *kv["kv_connector_module_path"].split(".")) + ".py"
    assert os.path.isfile(mod_file), f"{kv['kv_connector_module_path']} -> {mod_file} missing"
    with open(mod_file, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    names |= {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert kv["kv_connector"] in names


@pytest.mark.parametrize("path", [GLM, DSV])
def test_config_extra_config_is_accepted_by_the_connector(path):
    """kv_connector_extra_config goes to HiSparseConfig.from_extra_config on the server; a typo
    there must fail in CI, not 20 minutes into a nightly."""
    from hisparse.config import HiSparseConfig

    extra = load_config(path).kv_transfer_config()["kv_connector_extra_config"]
    cfg = HiSparseConfig.from_extra_config(extra)
    assert cfg.host_pool_gib == 32.0
    with pytest.raises(ValueError, match="host_pool_gb"):
        HiSparseConfig.from_extra_config({"host_pool_gb": 32})


# ----------------------------------------------------------------------------- schema errors


def test_good_dict_validates():
    cfg = validate(good_dict(env={"A": "1"}, temperature=0.0))
    assert cfg.env == {"A": "1"} and cfg.pass_floor == 0.5


@pytest.mark.parametrize("key", [k for k, (_, req, _) in SCHEMA.items() if req])
def test_missing_key_is_named(key):
    d = good_dict()
    del d[key]
    with pytest.raises(ConfigError, match=f"missing required key.*'{key}'"):
        validate(d, "cfg.yaml")


@pytest.mark.parametrize(
    "key,value",
    [
        ("model_name", 7),
        ("accuracy_threshold", "0.9"),
        ("accuracy_threshold", True),
        ("tolerance", None),
        ("num_questions", 10.5),
        ("num_questions", "1319"),
        ("num_fewshot", True),
        ("max_tokens", [256]),
        ("max_concurrency", 3.0),
        ("request_timeout_seconds", "1800"),
        ("startup_max_wait_seconds", None),
        ("server_args", ["--enforce-eager"]),
        ("env", ["A=1"]),
        ("temperature", "0"),
    ],
)
def test_mistyped_key_is_named(key, value):
    with pytest.raises(ConfigError, match=f"key '{key}' must be"):
        validate(good_dict(**{key: value}), "cfg.yaml")


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'acuracy_threshold'"):
        validate(good_dict(acuracy_threshold=0.9), "cfg.yaml")


@pytest.mark.parametrize(
    "key,value",
    [
        ("accuracy_threshold", 0.0),
        ("accuracy_threshold", 1.5),
        ("tolerance", -0.1),
        ("tolerance", 1.0),
        ("num_questions", 0),
        ("num_questions", 1320),
        ("num_fewshot", -1),
        ("max_tokens", 0),
        ("max_concurrency", 0),
        ("request_timeout_seconds", 0),
        ("startup_max_wait_seconds", -5),
        ("model_name", "  "),
        ("temperature", -1.0),
    ],
)
def test_out_of_range_value_is_named(key, value):
    with pytest.raises(ConfigError, match=f"key '{key}'"):
        validate(good_dict(**{key: value}), "cfg.yaml")


@pytest.mark.parametrize(
    "args,match",
    [
        ('--kv-transfer-config \'{"kv_connector":"x"}', "not valid shell syntax"),
        ("--kv-transfer-config '{kv_connector: x}'", "not valid JSON"),
        ("--kv-transfer-config '[1, 2]'", "JSON object with a 'kv_connector'"),
        ("nvidia/GLM-5.2-NVFP4 --enforce-eager", "must start with an option"),
        ("--model foo", "must not set --model"),
        ("--tensor-parallel-size four", "--tensor-parallel-size needs a positive integer"),
        ("--max-num-seqs 0", "--max-num-seqs needs a positive integer"),
    ],
)
def test_bad_server_args_are_explained(args, match):
    with pytest.raises(ConfigError, match=match) as ei:
        validate(good_dict(server_args=args), "cfg.yaml")
    assert "server_args" in str(ei.value)


def test_env_values_must_be_strings():
    with pytest.raises(ConfigError, match="key 'env' must map strings to strings.*'A'"):
        validate(good_dict(env={"A": 1}), "cfg.yaml")


def test_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(str(tmp_path / "absent.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_config(str(lst))
    models = tmp_path / "models.txt"
    models.write_text("# comment\n\nmissing.yaml\n")
    with pytest.raises(ConfigError, match=r"models.txt:3: listed config 'missing.yaml'"):
        read_model_list(str(models))
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ConfigError, match="lists no configs"):
        read_model_list(str(empty))


def test_shipped_configs_round_trip_through_yaml():
    # every shipped key is in the schema, so adding a key without a schema entry fails here
    for path in (GLM, DSV):
        with open(path) as f:
            data = yaml.safe_load(f)
        assert set(data) <= set(SCHEMA)
        assert validate(copy.deepcopy(data), path).model_name == data["model_name"]


# ----------------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    "text,expected",
    [
        ("#### 42", "42"),
        ("She pays 5 + 3 = 8 dollars.\n#### 8", "8"),
        ("The answer is 1,234.", "1234"),
        ("The answer is $1,234.50.", "1234.5"),
        ("#### -7", "-7"),
        ("####-7", "-7"),
        ("The temperature drops to -15 degrees.", "-15"),
        ("The answer is −3.", "-3"),
        ("The answer is 3.75", "3.75"),
        ("It costs 18.00 dollars.", "18"),
        ("answer: .5", "0.5"),
        ("#### 12\n\nQuestion: Tom has 99 apples", "12"),
        ("So the answer is 12. Then she buys 3 more for next week.", "12"),
        ("He has 5 apples, then 7 more, so 12 in total.", "12"),
        ("There are 2,000,000 people.", "2000000"),
        ("#### 1,000.", "1000"),
        ("The answer is **36**.", "36"),
        ("No number here.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_hash_answer_wins_over_later_numbers_and_answer_is_over_last_number():
    assert extract_answer("#### 5\nextra 9 and 10") == "5"
    assert extract_answer("the answer is 4; check: 2 + 2 = 4, 7") == "4"


def test_reference_and_comparison():
    assert extract_reference("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert extract_reference("...\n#### 1,080") == "1080"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        extract_reference("no final answer")
    assert is_correct("18", "18") and is_correct(normalize_number("18.00"), "18")
    assert not is_correct("17", "18") and not is_correct(None, "18")
    assert normalize_number("$1,234.50") == "1234.5" and normalize_number("abc") is None


# ----------------------------------------------------------------------------- prompts


def test_few_shot_prompt_layout():
    shots = [Example(f"Q{i}?", f"work {i}\n#### {i}") for i in range(5)]
    p = build_prompt(shots, Example("Final question?", "#### 99"))
    blocks = p.split("\n\n")
    assert len(blocks) == 6
    for i in range(5):
        assert blocks[i] == f"Question: Q{i}?\nAnswer: work {i}\n#### {i}"
    assert blocks[5] == "Question: Final question?\nAnswer:"
    assert "99" not in p  # the test answer never leaks into the prompt
    assert build_prompt([], Example("Only?", "#### 1")) == "Question: Only?\nAnswer:"
    assert "Question:" in STOP
    assert len(STOP) <= 4  # the OpenAI API / vLLM refuse more stop strings (HTTP 400)


# ----------------------------------------------------------------------------- pass/fail rule


def test_pass_rule_is_exact_at_the_edge():
    assert passes(1188, 1319, 0.90, 0.0)  # 0.90068
    assert not passes(1187, 1319, 0.90, 0.0)  # 0.89992
    assert passes(9, 10, 0.90, 0.0)  # exactly at the threshold
    assert not passes(8, 10, 0.90, 0.0)
    assert passes(8, 10, 0.90, 0.10)  # 0.8 >= 0.9 - 0.1 exactly
    assert not passes(7, 10, 0.90, 0.10)
    assert not passes(0, 0, 0.5, 0.0)


# ----------------------------------------------------------------------------- fake-server runs


def _dataset(n_test=20, n_train=5):
    test = [
        Example(
            f"What is {i} plus {i + 1}?",
            f"{i}+{i + 1}=<<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}\n#### {2 * i + 1}",
        )
        for i in range(n_test)
    ]
    train = [Example(f"Train question {i}?", f"It is {i}.\n#### {i}") for i in range(n_train)]
    return test, train


def _write_data(tmp_path, test, train):
    d = tmp_path / "gsm8k"
    d.mkdir(exist_ok=True)
    for name, rows in (("test", test), ("train", train)):
        with open(d / f"{name}.jsonl", "w") as f:
            for ex in rows:
                f.write(json.dumps({"question": ex.question, "answer": ex.answer}) + "\n")
    return str(d)


def _answers(test, n_correct, style="hash"):
    """Completions for the first n_correct questions right, the rest wrong by one."""
    out = {}
    for i, ex in enumerate(test):
        v = int(extract_reference(ex.answer)) + (0 if i < n_correct else 1)
        out[ex.question] = (
            f" So the total is {v:,}.\n#### {v}" if style == "hash" else f" The answer is {v:,}."
        )
    return out


def _cfg(**over):
    return validate(good_dict(**over), "fake.yaml")


def test_harness_scores_a_fake_server_and_applies_the_floor(tmp_path):
    test, train = _dataset(20, 5)
    data = _write_data(tmp_path, test, train)
    answers = _answers(test, n_correct=15)
    answers[test[19].question] = " I cannot tell."  # an invalid answer (and wrong)
    with FakeOpenAIServer("fake/model", answers, fail_questions=[test[18].question]) as srv:
        cfg = _cfg(num_questions=20, num_fewshot=5, max_concurrency=4)
        samples = tmp_path / "samples.jsonl"
        res = evaluate(cfg, srv.base_url, data_dir=data, samples_path=str(samples), quiet=True)
        assert (res.correct, res.invalid, res.request_errors) == (15, 1, 1)
        assert res.accuracy == 0.75 and res.passed
        assert res.first_errors and "HTTP 500" in res.first_errors[0]
        # concurrency: overlapping but never above the limit
        assert 1 < srv.max_in_flight <= 4
        # every request is a 5-shot completion with the stop sequences, greedy
        assert len(srv.requests) == 20
        req = srv.requests[0]
        assert req["model"] == "fake/model" and req["temperature"] == 0.0
        assert req["stop"] == STOP and req["max_tokens"] == 64
        assert req["prompt"].count("Question:") == 6
        assert all(f"Train question {i}?" in req["prompt"] for i in range(5))
        lines = [json.loads(x) for x in samples.read_text().splitlines()]
        assert len(lines) == 20 and sum(x["correct"] for x in lines) == 15

        strict = _cfg(num_questions=20, num_fewshot=5, accuracy_threshold=0.80)
        assert not evaluate(strict, srv.base_url, data_dir=data, quiet=True).passed
        tolerant = _cfg(num_questions=20, num_fewshot=5, accuracy_threshold=0.80, tolerance=0.05)
        assert evaluate(tolerant, srv.base_url, data_dir=data, quiet=True).passed


def test_cli_against_base_url_exit_codes_and_json(tmp_path):
    test, train = _dataset(10, 2)
    data = _write_data(tmp_path, test, train)
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
    with FakeOpenAIServer("fake/model", _answers(test, 9, style="answer_is")) as srv:
        assert run_gsm8k.main(common + ["--base-url", srv.base_url + "/v1"]) == 0
    doc = json.loads(out.read_text())
    assert doc["passed"] and doc["results"][0]["correct"] == 9
    with FakeOpenAIServer("fake/model", _answers(test, 8)) as srv:
        assert run_gsm8k.main(common + ["--base-url", srv.base_url]) == 1
    doc = json.loads(out.read_text())
    assert not doc["passed"] and doc["results"][0]["accuracy"] == 0.8
    # a smoke run with fewer questions keeps the floor
    with FakeOpenAIServer("fake/model", _answers(test, 8)) as srv:
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


def test_wrong_model_name_on_server_is_reported(tmp_path):
    test, train = _dataset(3, 0)
    data = _write_data(tmp_path, test, train)
    with FakeOpenAIServer("other/model") as srv:
        res = evaluate(
            _cfg(num_questions=3, num_fewshot=0, startup_max_wait_seconds=0.5),
            srv.base_url,
            data_dir=data,
            quiet=True,
        )
    assert not res.passed and "not ready" in res.error and "other/model" in res.error


def test_harness_starts_and_stops_the_server(tmp_path):
    """The launch path of the nightly, with the fake server standing in for `vllm serve`:
    the config's server args are passed, readiness is awaited, the process group is stopped."""
    test, train = _dataset(8, 2)
    data = _write_data(tmp_path, test, train)
    ans = tmp_path / "answers.json"
    ans.write_text(json.dumps(_answers(test, 8)))
    cfg = _cfg(
        num_questions=8,
        num_fewshot=2,
        accuracy_threshold=1.0,
        server_args=f"--ready-after 1.0 --answers {ans} --enforce-eager "
        '--kv-transfer-config \'{"kv_connector":"HiSparseConnector"}\'',
    )
    serve_cmd = f"{sys.executable} {FAKE_SERVER}"
    t0 = time.monotonic()
    res = run_config(
        cfg,
        serve_cmd=serve_cmd,
        log_dir=str(tmp_path / "logs"),
        check_gpus=False,
        data_dir=data,
        quiet=True,
    )
    assert res.error is None, res.error
    assert res.passed and res.correct == 8 and res.startup_s >= 0.9
    assert time.monotonic() - t0 < 30
    log = (tmp_path / "logs" / "fake.server.log").read_text()
    assert "fake server for fake/model" in log
    # the port is free again: the server process is gone
    assert _pids_with_arg(str(ans)) == []


def _pids_with_arg(arg):
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if arg.encode() in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def test_server_crash_and_startup_timeout_fail_fast(tmp_path):
    test, train = _dataset(2, 0)
    data = _write_data(tmp_path, test, train)
    serve_cmd = f"{sys.executable} {FAKE_SERVER}"
    crash = _cfg(
        num_questions=2,
        num_fewshot=0,
        startup_max_wait_seconds=60,
        server_args="--ready-after 100 --exit-after 0.5",
    )
    t0 = time.monotonic()
    res = run_config(
        crash,
        serve_cmd=serve_cmd,
        log_dir=str(tmp_path / "l1"),
        check_gpus=False,
        data_dir=data,
        quiet=True,
    )
    assert not res.passed and "exited during startup" in res.error
    assert time.monotonic() - t0 < 20
    slow = _cfg(
        num_questions=2, num_fewshot=0, startup_max_wait_seconds=1, server_args="--ready-after 100"
    )
    res = run_config(
        slow,
        serve_cmd=serve_cmd,
        log_dir=str(tmp_path / "l2"),
        check_gpus=False,
        data_dir=data,
        quiet=True,
    )
    assert not res.passed and "not ready after 1 s" in res.error and "log tail" in res.error
    missing = run_config(
        crash,
        serve_cmd="/nonexistent/vllm serve",
        log_dir=str(tmp_path / "l3"),
        check_gpus=False,
        data_dir=data,
        quiet=True,
    )
    assert not missing.passed and "cannot start" in missing.error


def test_too_few_gpus_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    res = run_config(
        load_config(GLM), serve_cmd="/nonexistent/vllm serve", log_dir=str(tmp_path), quiet=True
    )
    assert not res.passed and "needs 4 GPUs" in res.error and "2 visible" in res.error


def test_dataset_download_pages_and_caches(tmp_path):
    test, train = _dataset(250, 7)
    rows = {
        "test": [{"question": e.question, "answer": e.answer} for e in test],
        "train": [{"question": e.question, "answer": e.answer} for e in train],
    }
    cache = str(tmp_path / "cache")
    with FakeOpenAIServer("m", rows=rows) as srv:
        got = load_split("test", limit=None, cache_dir=cache, base_url=srv.base_url + "/rows")
        shots = load_split("train", limit=5, cache_dir=cache, base_url=srv.base_url + "/rows")
    assert got == test and shots == train[:5]
    assert os.path.isfile(os.path.join(cache, "test.jsonl"))
    # the server is gone: the cache answers
    assert (
        load_split("test", limit=100, cache_dir=cache, base_url="http://127.0.0.1:9") == test[:100]
    )
    with pytest.raises(DatasetError, match="failed"):
        load_split("train", limit=50, cache_dir=cache, base_url="http://127.0.0.1:9/rows")
    with pytest.raises(DatasetError, match="not found"):
        load_split("test", data_dir=str(tmp_path / "nope"))


_METRICS = """# HELP vllm:hisparse_cache_hits_total HiSparse hot-buffer hits
# TYPE vllm:hisparse_cache_hits_total counter
vllm:hisparse_cache_hits_total{engine="0",model_name="fake/model"} 1500.0
vllm:hisparse_cache_hits_total{engine="1",model_name="fake/model"} 500.0
vllm:hisparse_cache_hits_created{engine="0",model_name="fake/model"} 1.7e9
vllm:hisparse_cache_misses_total{engine="0",model_name="fake/model"} 42.0
vllm:hisparse_host_to_device_bytes_total{engine="0",model_name="fake/model"} 48384.0
vllm:num_requests_running{engine="0"} 3.0
"""


def test_hisparse_counters_are_scraped_into_the_result(tmp_path):
    """The run records the connector's exported counters (by their contract names), so a
    nightly log shows whether HiSparse was in the path at all."""
    test, train = _dataset(4, 0)
    data = _write_data(tmp_path, test, train)
    cfg = _cfg(num_questions=4, num_fewshot=0)
    with FakeOpenAIServer("fake/model", _answers(test, 4), metrics_text=_METRICS) as srv:
        res = evaluate(cfg, srv.base_url, data_dir=data, quiet=True)
    assert res.passed
    assert res.hisparse_metrics == {
        "vllm:hisparse_cache_hits": 2000.0,
        "vllm:hisparse_cache_misses": 42.0,
        "vllm:hisparse_host_to_device_bytes": 48384.0,
    }
    assert "cache_hits 2000" in res.summary_line()
    with FakeOpenAIServer("fake/model", _answers(test, 4)) as srv:  # no /metrics route
        res = evaluate(cfg, srv.base_url, data_dir=data, quiet=True)
    assert res.passed and res.hisparse_metrics == {}
    assert "no vllm:hisparse_* metrics exported" in res.summary_line()


def test_config_naming_vllms_in_tree_connector_for_this_package_is_refused(tmp_path):
    """vLLM 0.32 routes the name HiSparseConnector to its own CUDA path even with our module
    path: a nightly config saying so would never load this package."""
    p = tmp_path / "bad.yaml"
    text = (
        open(DSV)
        .read()
        .replace('"kv_connector":"HiSparseOOTConnector"', '"kv_connector":"HiSparseConnector"')
    )
    assert '"HiSparseConnector"' in text
    p.write_text(text)
    with pytest.raises(ConfigError, match="use 'HiSparseOOTConnector'"):
        load_config(str(p))
