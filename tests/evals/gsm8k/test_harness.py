"""evals/gsm8k/harness.py: the pass/fail rule, scoring against a fake OpenAI-compatible server
(in-process), readiness errors, the GPU check and the scraped HiSparse counters."""

from __future__ import annotations

import json

from evals.gsm8k.config import load_config
from evals.gsm8k.fake_server import FakeOpenAIServer
from evals.gsm8k.harness import evaluate, passes, run_config
from evals.gsm8k.prompts import STOP
from tests.evals.gsm8k.builders import GLM, canned_answers, make_cfg, make_dataset, write_data


def test_pass_rule_is_exact_at_the_edge():
    assert passes(1188, 1319, 0.90, 0.0)  # 0.90068
    assert not passes(1187, 1319, 0.90, 0.0)  # 0.89992
    assert passes(9, 10, 0.90, 0.0)  # exactly at the threshold
    assert not passes(8, 10, 0.90, 0.0)
    assert passes(8, 10, 0.90, 0.10)  # 0.8 >= 0.9 - 0.1 exactly
    assert not passes(7, 10, 0.90, 0.10)
    assert not passes(0, 0, 0.5, 0.0)


def test_harness_scores_a_fake_server_and_applies_the_floor(tmp_path):
    test, train = make_dataset(20, 5)
    data = write_data(tmp_path, test, train)
    answers = canned_answers(test, n_correct=15)
    answers[test[19].question] = " I cannot tell."  # an invalid answer (and wrong)
    with FakeOpenAIServer("fake/model", answers, fail_questions=[test[18].question]) as srv:
        cfg = make_cfg(num_questions=20, num_fewshot=5, max_concurrency=4)
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

        strict = make_cfg(num_questions=20, num_fewshot=5, accuracy_threshold=0.80)
        assert not evaluate(strict, srv.base_url, data_dir=data, quiet=True).passed
        tolerant = make_cfg(
            num_questions=20, num_fewshot=5, accuracy_threshold=0.80, tolerance=0.05
        )
        assert evaluate(tolerant, srv.base_url, data_dir=data, quiet=True).passed


def test_wrong_model_name_on_server_is_reported(tmp_path):
    test, train = make_dataset(3, 0)
    data = write_data(tmp_path, test, train)
    with FakeOpenAIServer("other/model") as srv:
        res = evaluate(
            make_cfg(num_questions=3, num_fewshot=0, startup_max_wait_seconds=0.5),
            srv.base_url,
            data_dir=data,
            quiet=True,
        )
    assert not res.passed and "not ready" in res.error and "other/model" in res.error


def test_too_few_gpus_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    res = run_config(
        load_config(GLM), serve_cmd="/nonexistent/vllm serve", log_dir=str(tmp_path), quiet=True
    )
    assert not res.passed and "needs 4 GPUs" in res.error and "2 visible" in res.error


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
    test, train = make_dataset(4, 0)
    data = write_data(tmp_path, test, train)
    cfg = make_cfg(num_questions=4, num_fewshot=0)
    with FakeOpenAIServer("fake/model", canned_answers(test, 4), metrics_text=_METRICS) as srv:
        res = evaluate(cfg, srv.base_url, data_dir=data, quiet=True)
    assert res.passed
    assert res.hisparse_metrics == {
        "vllm:hisparse_cache_hits": 2000.0,
        "vllm:hisparse_cache_misses": 42.0,
        "vllm:hisparse_host_to_device_bytes": 48384.0,
    }
    assert "cache_hits 2000" in res.summary_line()
    with FakeOpenAIServer("fake/model", canned_answers(test, 4)) as srv:  # no /metrics route
        res = evaluate(cfg, srv.base_url, data_dir=data, quiet=True)
    assert res.passed and res.hisparse_metrics == {}
    assert "no vllm:hisparse_* metrics exported" in res.summary_line()
