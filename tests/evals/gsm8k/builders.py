"""Shared builders for the GSM8K harness tests: a valid config dict, a tiny synthetic dataset
written as the harness reads it, and canned completions (some right, some wrong)."""

from __future__ import annotations

import json
import os

from evals.gsm8k.answers import extract_reference
from evals.gsm8k.config import validate
from evals.gsm8k.dataset import Example
from tests import REPO_ROOT

CONFIGS = os.path.join(str(REPO_ROOT), "evals", "gsm8k", "configs")
GLM = os.path.join(CONFIGS, "GLM-5.2-NVFP4-HiSparse.yaml")
DSV = os.path.join(CONFIGS, "DeepSeek-V3.2-HiSparse.yaml")
FAKE_SERVER = os.path.join(str(REPO_ROOT), "evals", "gsm8k", "fake_server.py")


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


def make_dataset(n_test=20, n_train=5):
    test = [
        Example(
            f"What is {i} plus {i + 1}?",
            f"{i}+{i + 1}=<<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}\n#### {2 * i + 1}",
        )
        for i in range(n_test)
    ]
    train = [Example(f"Train question {i}?", f"It is {i}.\n#### {i}") for i in range(n_train)]
    return test, train


def write_data(tmp_path, test, train):
    d = tmp_path / "gsm8k"
    d.mkdir(exist_ok=True)
    for name, rows in (("test", test), ("train", train)):
        with open(d / f"{name}.jsonl", "w") as f:
            for ex in rows:
                f.write(json.dumps({"question": ex.question, "answer": ex.answer}) + "\n")
    return str(d)


def canned_answers(test, n_correct, style="hash"):
    """Completions for the first n_correct questions right, the rest wrong by one."""
    out = {}
    for i, ex in enumerate(test):
        v = int(extract_reference(ex.answer)) + (0 if i < n_correct else 1)
        out[ex.question] = (
            f" So the total is {v:,}.\n#### {v}" if style == "hash" else f" The answer is {v:,}."
        )
    return out


def make_cfg(**over):
    return validate(good_dict(**over), "fake.yaml")
