"""evals/gsm8k/dataset.py: paged download (HF rows API, served by the fake server), the cache,
and the errors."""

from __future__ import annotations

import os

import pytest

from evals.gsm8k.dataset import DatasetError, load_split
from evals.gsm8k.fake_server import FakeOpenAIServer
from tests.evals.gsm8k.builders import make_dataset


def test_dataset_download_pages_and_caches(tmp_path):
    test, train = make_dataset(250, 7)
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
