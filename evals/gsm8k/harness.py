"""Run one GSM8K config: prompts, completions, scoring and the pass/fail rule."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from fractions import Fraction
from typing import Any, Dict, List, Optional

from evals.gsm8k import server as server_mod
from evals.gsm8k.answers import extract_answer, extract_reference, is_correct
from evals.gsm8k.client import OpenAIClient, ServerError
from evals.gsm8k.config import EvalConfig
from evals.gsm8k.dataset import DEFAULT_CACHE, HF_ROWS_URL, load_split
from evals.gsm8k.prompts import STOP, build_prompt


def passes(correct: int, total: int, threshold: float, tolerance: float) -> bool:
    """accuracy >= threshold - tolerance, computed exactly (no float rounding at the edge:
    0.9 with 1319 questions needs 1188 correct, 1187 fails)."""
    if total <= 0:
        return False
    floor = Fraction(Decimal(repr(float(threshold)))) - Fraction(Decimal(repr(float(tolerance))))
    return Fraction(correct, total) >= floor


@dataclass
class EvalResult:
    config: str
    model: str
    num_questions: int
    correct: int = 0
    invalid: int = 0  # completions with no number in them
    request_errors: int = 0  # HTTP / timeout failures (scored as wrong)
    accuracy: float = 0.0
    threshold: float = 0.0
    tolerance: float = 0.0
    passed: bool = False
    error: Optional[str] = None  # set when the run could not complete (server never ready, ...)
    startup_s: float = 0.0
    eval_s: float = 0.0
    completion_tokens: int = 0
    first_errors: List[str] = field(default_factory=list)
    # the server's HiSparse counters after the run (vllm:hisparse_cache_hits, ..._misses,
    # ..._host_to_device_bytes): evidence the connector was loaded; informational
    hisparse_metrics: Dict[str, float] = field(default_factory=dict)

    def summary_line(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        if self.error:
            return f"{verdict} {self.model} ({self.config}): {self.error}"
        floor = self.threshold - self.tolerance
        m = self.hisparse_metrics
        if m:
            hs = "hisparse counters: " + ", ".join(
                f"{k.replace('vllm:hisparse_', '')} {v:.0f}" for k, v in sorted(m.items())
            )
        else:
            hs = "no vllm:hisparse_* metrics exported (was the connector loaded?)"
        return (
            f"{verdict} {self.model}: accuracy {self.accuracy:.4f} "
            f"({self.correct}/{self.num_questions}) vs floor {floor:.4f} "
            f"(threshold {self.threshold} - tolerance {self.tolerance}); "
            f"invalid {self.invalid}, request errors {self.request_errors}, "
            f"{self.eval_s:.1f} s; {hs}"
        )

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def evaluate(
    cfg: EvalConfig,
    base_url: str,
    *,
    data_dir: Optional[str] = None,
    num_questions: Optional[int] = None,
    cache_dir: str = DEFAULT_CACHE,
    dataset_url: str = HF_ROWS_URL,
    samples_path: Optional[str] = None,
    wait_ready: bool = True,
    alive=None,
    quiet: bool = False,
) -> EvalResult:
    """Evaluate against a running server at `base_url`."""
    n = num_questions if num_questions is not None else cfg.num_questions
    res = EvalResult(
        config=cfg.source,
        model=cfg.model_name,
        num_questions=n,
        threshold=cfg.accuracy_threshold,
        tolerance=cfg.tolerance,
    )
    client = OpenAIClient(base_url, cfg.model_name, timeout=cfg.request_timeout_seconds)
    if wait_ready:
        try:
            res.startup_s = client.wait_ready(cfg.startup_max_wait_seconds, alive=alive)
        except ServerError as e:
            res.error = str(e)
            return res
    tests = load_split(
        "test", data_dir=data_dir, limit=n, cache_dir=cache_dir, base_url=dataset_url
    )
    shots = (
        load_split(
            "train",
            data_dir=data_dir,
            limit=cfg.num_fewshot,
            cache_dir=cache_dir,
            base_url=dataset_url,
        )
        if cfg.num_fewshot
        else []
    )
    prompts = [build_prompt(shots, q) for q in tests]

    def progress(done: int, total: int) -> None:
        if not quiet and (done == total or done % max(1, total // 20) == 0):
            print(f"  {done}/{total} answered", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    outs = client.complete_many(
        prompts,
        max_concurrency=cfg.max_concurrency,
        max_tokens=cfg.max_tokens,
        temperature=cfg.temperature,
        stop=STOP,
        progress=progress,
    )
    res.eval_s = time.monotonic() - t0
    samples = []
    for i, (q, out) in enumerate(zip(tests, outs)):
        ref = extract_reference(q.answer)
        pred = extract_answer(out.text) if out.text is not None else None
        ok = is_correct(pred, ref)
        res.correct += ok
        res.completion_tokens += out.completion_tokens
        if out.text is None:
            res.request_errors += 1
            if len(res.first_errors) < 5:
                res.first_errors.append(f"question {i}: {out.error}")
        elif pred is None:
            res.invalid += 1
        samples.append(
            {
                "index": i,
                "reference": ref,
                "predicted": pred,
                "correct": ok,
                "completion": out.text,
                "error": out.error,
            }
        )
    res.accuracy = res.correct / n
    res.hisparse_metrics = client.scrape_metrics()
    res.passed = passes(res.correct, n, cfg.accuracy_threshold, cfg.tolerance)
    if samples_path:
        os.makedirs(os.path.dirname(os.path.abspath(samples_path)), exist_ok=True)
        with open(samples_path, "w", encoding="utf-8") as f:
            for s in samples:
                f.write(json.dumps(s) + "\n")
    return res


def run_config(
    cfg: EvalConfig,
    *,
    base_url: Optional[str] = None,
    serve_cmd: str = server_mod.DEFAULT_SERVE_CMD,
    port: Optional[int] = None,
    log_dir: str = "gsm8k-logs",
    check_gpus: bool = True,
    **kwargs,
) -> EvalResult:
    """Evaluate `cfg`: against `base_url` if given, else start a server for it first."""
    if base_url is not None:
        return evaluate(cfg, base_url, **kwargs)
    if check_gpus:
        need, have = cfg.gpus_needed(), server_mod.visible_gpu_count()
        if have < need:
            res = EvalResult(
                config=cfg.source,
                model=cfg.model_name,
                num_questions=kwargs.get("num_questions") or cfg.num_questions,
                threshold=cfg.accuracy_threshold,
                tolerance=cfg.tolerance,
            )
            res.error = (
                f"needs {need} GPUs (tensor x pipeline x data parallel in server_args), "
                f"{have} visible; not starting the server"
            )
            return res
    port = port or server_mod.free_port()
    stem = os.path.splitext(os.path.basename(cfg.source))[0] or "server"
    log_path = os.path.join(log_dir, f"{stem}.server.log")
    srv = server_mod.ServerProcess(cfg, port, log_path, serve_cmd=serve_cmd)
    try:
        srv.start()
    except RuntimeError as e:
        res = EvalResult(
            config=cfg.source,
            model=cfg.model_name,
            num_questions=kwargs.get("num_questions") or cfg.num_questions,
            threshold=cfg.accuracy_threshold,
            tolerance=cfg.tolerance,
            error=str(e),
        )
        return res
    try:
        res = evaluate(cfg, f"http://127.0.0.1:{port}", alive=srv.alive, **kwargs)
    finally:
        srv.stop()
    if res.error:
        res.error += f"; server log: {log_path}\n--- log tail ---\n{srv.log_tail()}"
    return res
