#!/usr/bin/env python3
"""HiSparse vs all-resident parity on the DSA engine, with negative controls.

    python evals/parity/run_parity.py                     # full profile, seeds 0 1 2, CPU
    python evals/parity/run_parity.py --profile ci        # the small CI configuration
    python evals/parity/run_parity.py --seeds 5 6 --scenario hot-eq-topk-g4 --json out.json
    python evals/parity/run_parity.py --device cuda       # on a GPU
    python evals/parity/run_parity.py --profile hybrid-ci # hybrid residency, forced spills

Threshold: 100% identical tokens, bit-identical attention outputs (every layer, every token)
and final hidden states on every (scenario, seed), each scenario exercising what it claims
(misses, evictions, state-row reuse, contexts several times the hot buffer, device rows at
most a fraction of resident's; in the hybrid profiles, spills mid-request and returns); and
the negative controls (per-layer binding broken: every layer at the base offset; in the hybrid
profiles also a spill one row short) must be detected.

Exit status: 0 PASS, 1 FAIL, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script: make `evals` importable from the repo root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from evals.parity.parity import (  # noqa: E402
    DEFAULT_SEEDS,
    PROFILES,
    SCENARIO_NAMES,
    run_parity,
    scenarios,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_parity.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="full",
        help="full (default, minutes on a CPU) or ci (seconds): HiSparse, every row in the "
        "host pool; hybrid / hybrid-ci: hybrid residency with forced spills",
    )
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help=f"seeds (default: {DEFAULT_SEEDS['full']} full, {DEFAULT_SEEDS['ci']} ci)",
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=list(SCENARIO_NAMES),
        help="run only this scenario (repeatable; default: all)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument(
        "--no-negative-control",
        action="store_true",
        help="skip the negative controls (the verdict then only covers parity)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads while running (default 1; 0 = leave torch's default)",
    )
    p.add_argument("--json", dest="json_path", help="write the full report as JSON here")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        chosen = scenarios(args.profile, args.scenario)
    except ValueError as e:
        parser.error(str(e))
    if args.list:
        for sc in chosen:
            print(f"{sc.name:<22} {sc.description}\n{'':<22} {sc.workload}")
        return 0
    if args.seeds is not None and any(s < 0 for s in args.seeds):
        parser.error("--seeds must be >= 0")
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device: not a torch device: {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    log = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    report = run_parity(
        profile=args.profile,
        seeds=args.seeds,
        names=args.scenario,
        device=args.device,
        negative_control=not args.no_negative_control,
        threads=args.threads or None,
        log=log,
    )
    print(report.table())
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
