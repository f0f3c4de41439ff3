#!/usr/bin/env python3
"""5-shot GSM8K against `vllm serve` with the HiSparse connector (or any OpenAI-compatible
server), with a pass/fail floor per config.

    # start the server from the config, evaluate, stop it (the nightly):
    python evals/gsm8k/run_gsm8k.py --config evals/gsm8k/configs/GLM-5.2-NVFP4-HiSparse.yaml
    # every config of a list:
    python evals/gsm8k/run_gsm8k.py --config-list evals/gsm8k/configs/models-hisparse.txt
    # against a server you started yourself:
    python evals/gsm8k/run_gsm8k.py --config CFG.yaml --base-url http://localhost:8000
    # check the configs only:
    python evals/gsm8k/run_gsm8k.py --validate-only \
        --config-list evals/gsm8k/configs/models-hisparse.txt

Exit status: 0 every config passed; 1 a config failed (accuracy below threshold - tolerance,
server never ready, too few GPUs, data unavailable); 2 bad arguments or an invalid config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `evals` importable from the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from evals.gsm8k.config import ConfigError, EvalConfig, load_config, read_model_list  # noqa: E402
from evals.gsm8k.dataset import DEFAULT_CACHE, HF_ROWS_URL, DatasetError  # noqa: E402
from evals.gsm8k.harness import EvalResult, run_config  # noqa: E402
from evals.gsm8k.server import DEFAULT_SERVE_CMD  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_gsm8k.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", action="append", help="a config YAML (repeatable)")
    src.add_argument("--config-list", help="a models-*.txt file listing config YAMLs")
    p.add_argument("--base-url", help="evaluate a running server instead of starting one")
    p.add_argument(
        "--serve-cmd",
        default=DEFAULT_SERVE_CMD,
        help=f"command that starts the server (default: {DEFAULT_SERVE_CMD!r})",
    )
    p.add_argument("--port", type=int, help="server port (default: a free one)")
    p.add_argument(
        "--data-dir",
        help="folder with GSM8K test.jsonl and train.jsonl (default: download once into the cache)",
    )
    p.add_argument("--cache-dir", default=DEFAULT_CACHE)
    p.add_argument("--dataset-url", default=HF_ROWS_URL, help="HF dataset-viewer rows API URL")
    p.add_argument(
        "--num-questions",
        type=int,
        help="override num_questions (smoke runs; the floor still applies)",
    )
    p.add_argument(
        "--log-dir",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "logs"),
        help="server logs and per-question samples (default: evals/gsm8k/logs/)",
    )
    p.add_argument("--json", dest="json_path", help="write the results as JSON here")
    p.add_argument(
        "--skip-gpu-check",
        action="store_true",
        help="start the server even if fewer GPUs are visible than the config needs",
    )
    p.add_argument("--validate-only", action="store_true", help="check the configs and exit")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.num_questions is not None and args.num_questions < 1:
        parser.error("--num-questions must be >= 1")
    try:
        paths = read_model_list(args.config_list) if args.config_list else list(args.config)
        configs: List[EvalConfig] = [load_config(p) for p in paths]
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.validate_only:
        for c in configs:
            print(
                f"ok  {c.source}: {c.model_name}, {c.num_questions} questions, "
                f"{c.num_fewshot}-shot, floor {c.pass_floor:.4f}, {c.gpus_needed()} GPUs"
            )
        return 0
    if args.base_url and len(configs) > 1:
        print("error: --base-url evaluates one server; give exactly one --config", file=sys.stderr)
        return 2

    results: List[EvalResult] = []
    for cfg in configs:
        if not args.quiet:
            print(f"== {cfg.model_name} ({cfg.source})", file=sys.stderr, flush=True)
        stem = os.path.splitext(os.path.basename(cfg.source))[0]
        try:
            res = run_config(
                cfg,
                base_url=args.base_url,
                serve_cmd=args.serve_cmd,
                port=args.port,
                log_dir=args.log_dir,
                check_gpus=not args.skip_gpu_check,
                data_dir=args.data_dir,
                num_questions=args.num_questions,
                cache_dir=args.cache_dir,
                dataset_url=args.dataset_url,
                samples_path=os.path.join(args.log_dir, f"{stem}.samples.jsonl"),
                quiet=args.quiet,
            )
        except DatasetError as e:
            res = EvalResult(
                config=cfg.source,
                model=cfg.model_name,
                num_questions=args.num_questions or cfg.num_questions,
                threshold=cfg.accuracy_threshold,
                tolerance=cfg.tolerance,
                error=f"GSM8K data unavailable: {e}",
            )
        results.append(res)
        print(res.summary_line(), flush=True)
        for err in res.first_errors:
            print(f"  request error: {err}", flush=True)

    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(
                {
                    "passed": all(r.passed for r in results),
                    "results": [r.to_dict() for r in results],
                },
                f,
                indent=2,
            )
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
