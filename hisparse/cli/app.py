"""The `hisparse` command line: `info`, `demo`, `bench`, `plan`, `export-model`.

This module declares the commands and runs one (``main``, the console script). Flag types and
shared flag groups are in hisparse.cli.flags, what each command does in hisparse.cli.commands.
Every bad value exits with status 2 and one line naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional, Sequence

from hisparse import __version__
from hisparse.cli.commands import (
    cmd_bench,
    cmd_demo,
    cmd_export_model,
    cmd_info,
    cmd_plan,
)
from hisparse.cli.demo_model import add_checkpoint_flags
from hisparse.cli.errors import CommandError
from hisparse.cli.flags import (
    RETIRED,
    _Parser,
    add_progress_flag,
    add_retired_flags,
    add_workload_flags,
    float_range,
    int_list,
    int_range,
    output_path,
    port,
)
from hisparse.ops.limits import MAX_HOT_SIZE

# Importable from here as before the split (tests, scripts).
__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hisparse",
        description="HiSparse hot-buffering for sparse-attention inference.",
    )
    parser.add_argument("--version", action="version", version=f"hisparse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", help="print the version, torch, built backends and GPUs")
    p.set_defaults(func=cmd_info)
    _add_demo_command(sub)
    _add_bench_command(sub)
    _add_plan_command(sub)
    _add_export_model_command(sub)
    return parser


def _add_demo_command(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run one workload resident vs HiSparse vs hybrid and check token parity",
        description="Run one workload on the DSA engine in each residency mode: every latent "
        "row on the device (resident), rows in the host pool with small hot buffers (hisparse), "
        "device pages under a budget with requests spilled beyond it (hybrid). The model is a "
        "tiny seeded GLM-5 / DeepSeek-V3.2 checkpoint generated for the run, or --model DIR. "
        "Prints a summary; exits 1 if the runs' tokens differ.",
    )
    g = add_workload_flags(p, requests=16, concurrency=8, prompt_len=256, output_len=48)
    g.add_argument(
        "--hot-size",
        type=int_range(1, MAX_HOT_SIZE),
        default=None,
        help="hot-buffer rows per request per layer, >= --top-k (default: 2 x top-k)",
    )
    g.add_argument(
        "--device-blocks",
        type=int_range(0, 1 << 24),
        default=None,
        metavar="N",
        help="hybrid's device budget in blocks of 16 rows (requests beyond it spilled to the "
        "host pool); 0 = no hybrid run (default: half the running requests' blocks)",
    )
    add_checkpoint_flags(p)
    o = p.add_argument_group("output")
    o.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        help="serve Prometheus /metrics on this port, with the HiSparse run's counters once it "
        "ends (0 = any free port)",
    )
    o.add_argument(
        "--json",
        type=output_path((".json",)),
        default=None,
        metavar="PATH",
        help="write the summary as JSON",
    )
    add_progress_flag(o)
    add_retired_flags(p, tuple(RETIRED))
    p.set_defaults(func=cmd_demo, _parser=p)


def _add_bench_command(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="op micro-benchmarks and hit rate vs hot-buffer size",
        description="Micro-benchmarks of resolve/gather, then a sweep of hit rate against "
        "hot-buffer size: the DSA engine's HiSparse mode on the demo's workload (a generated "
        "tiny checkpoint, or --model DIR).",
    )
    add_workload_flags(p, requests=8, concurrency=4, prompt_len=256, output_len=32)
    add_checkpoint_flags(p)
    b = p.add_argument_group("bench")
    b.add_argument(
        "--hot-sizes",
        type=int_list(1, MAX_HOT_SIZE),
        default=None,
        metavar="H1,H2,...",
        help="hot-buffer sizes to sweep, each >= --top-k (default: 1, 1.25, 1.5, 2, 3, 4 x top-k)",
    )
    b.add_argument("--skip-ops", action="store_true", help="skip the op micro-benchmarks")
    add_progress_flag(b)
    b.add_argument(
        "--op-reps",
        type=int_range(1, 10000),
        default=5,
        help="repetitions per op configuration (default: 5)",
    )
    b.add_argument(
        "--plot",
        type=output_path((".png",)),
        default=None,
        metavar="PATH.png",
        help="draw hit rate and H2D bytes against hot-buffer size",
    )
    b.add_argument(
        "--json",
        type=output_path((".json",)),
        default=None,
        metavar="PATH",
        help="write all results as JSON",
    )
    add_retired_flags(p, ("--recent-window", "--metrics-interval"))
    p.set_defaults(func=cmd_bench, _parser=p)


def _add_plan_command(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="capacity calculator: concurrency with and without HiSparse, host pool, PCIe",
        description="Size a deployment: max concurrent requests with and without HiSparse, the "
        "host pool they need, and host->device traffic per decode step. Formulas: docs/plan.md.",
    )
    from hisparse.cli.plan import add_plan_flags

    add_plan_flags(p, int_range=int_range, float_range=float_range, output_path=output_path)
    p.set_defaults(func=cmd_plan, _parser=p)


def _add_export_model_command(sub) -> None:
    p = sub.add_parser(
        "export-model",
        help="write a seeded tiny DeepSeek-V3.2 or GLM-5 checkpoint vLLM serves",
        description="Write config.json, model.safetensors (seeded weights) and a byte-level "
        "tokenizer into DIR: a tiny checkpoint of a real architecture (real latent sizes), for "
        "`python -m vllm.entrypoints.openai.api_server --model DIR` with hisparse's class via "
        "--hf-overrides (with or without the HiSparse connector). No network needed.",
    )
    p.add_argument(
        "--arch",
        choices=("deepseek_v32", "glm_moe_dsa"),
        default="deepseek_v32",
        help="the checkpoint's architecture: deepseek_v32 (default) or glm_moe_dsa",
    )
    p.add_argument(
        "dir",
        metavar="DIR",
        help="output directory: created if missing, replaced whole if it holds an earlier export",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace DIR whole even if it holds files that are not an earlier export's",
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--layers", type=int_range(1, 1024), default=2, help="decoder layers (default: 2)"
    )
    m.add_argument(
        "--top-k",
        type=int_range(1, MAX_HOT_SIZE),
        default=64,
        help="the indexer's tokens selected per request per step (default: 64)",
    )
    m.add_argument(
        "--max-model-len",
        type=int_range(2, 1 << 20),
        default=2048,
        help="longest context in tokens (default: 2048)",
    )
    m.add_argument(
        "--seed",
        type=int_range(0, 2**31 - 1),
        default=0,
        help="weights seed (default: 0)",
    )
    p.set_defaults(func=cmd_export_model, _parser=p)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command; returns its exit status. Errors raise SystemExit with one line on
    stderr that names the command (HISPARSE_TRACEBACK=1 re-raises them for debugging)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    sub: argparse.ArgumentParser = getattr(args, "_parser", parser)
    if unknown:
        sub.error(f"unrecognized arguments: {' '.join(unknown)}")
    func: Optional[Callable[[argparse.Namespace], int]] = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        print(f"\n{sub.prog}: interrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except CommandError as e:
        sub.exit(e.code, f"{sub.prog}: error: {_one_line(e)}\n")
    except Exception as e:  # noqa: BLE001  (a command never ends in a traceback)
        if os.environ.get("HISPARSE_TRACEBACK", "") not in ("", "0"):
            raise
        sub.exit(
            1,
            f"{sub.prog}: error: {type(e).__name__}: {_one_line(e)} "
            f"(HISPARSE_TRACEBACK=1 shows where)\n",
        )
    return 1  # unreachable: sub.exit raises


def _one_line(e: BaseException) -> str:
    # The first line carries the message; torch appends C++ frames on the lines after it.
    text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
    return text if len(text) <= 400 else text[:397] + "..."


if __name__ == "__main__":
    sys.exit(main())
