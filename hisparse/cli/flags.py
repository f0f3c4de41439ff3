"""Flag types and shared flag groups of the `hisparse` command line.

The validators are argparse ``type=`` callables: a bad value raises ``ArgumentTypeError`` and
argparse prints one line naming the flag, exit status 2. The workload and model flag groups are
shared by `demo`, `bench` and `export-model`. Imports no torch (``hisparse --help`` stays fast).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Callable, Optional, Sequence

from hisparse.ops.limits import MAX_HOT_SIZE


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`hisparse demo: error: ...`), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int(text: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    try:
        v = int(text, 10)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if lo is not None and v < lo:
        raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
    return v


def int_range(lo: Optional[int] = None, hi: Optional[int] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        return _int(text, lo, hi)

    parse.__name__ = "integer"
    return parse


def float_range(
    lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if v < lo or (lo_open and v == lo) or v > hi or (hi_open and v == hi):
            left = "(" if lo_open else "["
            right = ")" if hi_open else "]"
            hi_s = "inf" if hi == math.inf else f"{hi:g}"
            raise argparse.ArgumentTypeError(f"must be in {left}{lo:g}, {hi_s}{right}, got {v:g}")
        return v

    parse.__name__ = "number"
    return parse


def port(text: str) -> int:
    return _int(text, 0, 65535)


def output_path(suffixes: Sequence[str] = ()) -> Callable[[str], str]:
    """A file path we can write: its directory exists (or can be created) and is writable."""

    def parse(text: str) -> str:
        if not text or text.endswith(os.sep):
            raise argparse.ArgumentTypeError(f"expected a file path, got {text!r}")
        if suffixes and not text.lower().endswith(tuple(suffixes)):
            raise argparse.ArgumentTypeError(f"must end in {' or '.join(suffixes)}, got {text!r}")
        if os.path.isdir(text):
            raise argparse.ArgumentTypeError(f"{text!r} is a directory")
        d = os.path.dirname(os.path.abspath(text))
        probe = d
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
            raise argparse.ArgumentTypeError(
                f"cannot write {text!r}: {probe!r} is not a writable directory"
            )
        # os.access answers yes to root everywhere, and a read-only mount only fails the write
        # itself; try it now rather than after the run.
        try:
            if os.path.exists(text):
                with open(text, "ab"):
                    pass
            else:
                with tempfile.TemporaryFile(dir=probe):
                    pass
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot write {text!r}: {e.strerror or e}") from None
        return text

    parse.__name__ = "path"
    return parse


def int_list(lo: int, hi: int) -> Callable[[str], list]:
    def parse(text: str) -> list:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        return sorted(set(_int(p.strip(), lo, hi) for p in parts))

    parse.__name__ = "list"
    return parse


# ---- shared flag groups ----------------------------------------------------------------

_ENGINE_FLAG = {  # EngineConfig field -> flag, for cross-flag errors
    "num_layers": "--layers",
    "index_share": "--index-share",
    "top_k": "--top-k",
    "hot_size": "--hot-size",
    "num_requests": "--requests",
    "max_running": "--concurrency",
    "prompt_len": "--prompt-len",
    "output_len": "--output-len",
    "drift": "--drift",
    "recent_window": "--recent-window",
    "seed": "--seed",
    "metrics_interval": "--metrics-interval",
    "row_format": "--row-format",
}


# EngineConfig's cross-field messages ("max_running * hot_size must fit ...") -> their flags.
_ENGINE_PRODUCTS = {
    "max_running * hot_size": ("--concurrency", "--hot-size"),
    "max_running * max context": ("--concurrency", "(--prompt-len + --output-len)"),
}


def add_progress_flag(g) -> None:
    """``--no-progress``, shared by the commands that draw progress bars (demo, bench)."""
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def add_model_flags(g, *, layers: int) -> None:
    """The reference model's shape, shared by the engine commands and export-model."""
    g.add_argument(
        "--layers",
        type=int_range(1, 1024),
        default=layers,
        help=f"decoder layers (default: {layers})",
    )
    g.add_argument(
        "--index-share",
        type=int_range(1, 1024),
        default=2,
        help="layers per index group: a leader and the followers reusing its top-k (default: 2)",
    )
    g.add_argument(
        "--top-k",
        type=int_range(1, MAX_HOT_SIZE),
        default=64,
        help="tokens selected per request per step (default: 64)",
    )
    g.add_argument(
        "--row-format",
        "--row-layout",
        choices=("fp8", "bf16", "f32"),
        default=None,
        help="latent row bytes: fp8 656 B, bf16 1152 B, f32 2304 B (default fp8; f32 with --model)",
    )
    g.add_argument(
        "--drift",
        type=float_range(0.0, 1.0),
        default=0.05,
        help="indexer query drift per token, 0 = frozen, 1 = memoryless (default: 0.05)",
    )
    g.add_argument(
        "--recent-window",
        type=int_range(0, MAX_HOT_SIZE),
        default=8,
        help="newest tokens always selected (default: 8)",
    )
    g.add_argument(
        "--seed",
        type=int_range(0, 2**31 - 1),
        default=0,
        help="weights (and prompts) seed (default: 0)",
    )


def add_workload_flags(
    p: argparse.ArgumentParser,
    *,
    requests: int,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    hot_size: bool = True,
) -> None:
    """The reference-engine workload of `demo` and `bench` (defaults differ per command)."""
    g = p.add_argument_group("workload (reference engine)")
    g.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the engine runs (default: cpu)",
    )
    _add_request_flags(
        g,
        requests=requests,
        concurrency=concurrency,
        prompt_len=prompt_len,
        output_len=output_len,
    )
    add_model_flags(g, layers=4)
    if hot_size:
        g.add_argument(
            "--hot-size",
            type=int_range(1, MAX_HOT_SIZE),
            default=None,
            help="hot-buffer rows per request per layer, >= --top-k (default: 2 x top-k)",
        )
    g.add_argument(
        "--metrics-interval",
        type=int_range(1, 1_000_000),
        default=16,
        help="engine steps between counter snapshots (default: 16)",
    )
    g.add_argument(
        "--threads",
        type=int_range(0, 1024),
        default=1,
        help="torch CPU threads for the run; 0 = leave torch's default (default: 1: "
        "the engine's ops are small)",
    )


def _add_request_flags(g, *, requests: int, concurrency: int, prompt_len: int, output_len: int):
    g.add_argument(
        "--requests",
        type=int_range(1, 1_000_000),
        default=requests,
        help=f"requests in the workload (default: {requests})",
    )
    g.add_argument(
        "--concurrency",
        type=int_range(1, 65536),
        default=concurrency,
        help=f"max requests running at once = state rows (default: {concurrency})",
    )
    g.add_argument(
        "--prompt-len",
        type=int_range(1, 1 << 20),
        default=prompt_len,
        help=f"prompt tokens per request, before jitter (default: {prompt_len})",
    )
    g.add_argument(
        "--output-len",
        type=int_range(1, 1 << 20),
        default=output_len,
        help=f"generated tokens per request, before jitter (default: {output_len})",
    )


def check_engine_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, **over):
    """Build the EngineConfig; a cross-flag problem becomes one line naming the flags."""
    from hisparse.cli.engine_args import engine_config_from_args

    if getattr(args, "hot_size", None) is not None and args.hot_size < args.top_k:
        parser.error(f"argument --hot-size: must be >= --top-k ({args.top_k}), got {args.hot_size}")
    if args.recent_window > args.top_k:
        parser.error(
            f"argument --recent-window: must be <= --top-k ({args.top_k}), got {args.recent_window}"
        )
    if args.index_share > args.layers:
        parser.error(
            f"argument --index-share: must be <= --layers ({args.layers}), got {args.index_share}"
        )
    try:
        return engine_config_from_args(args, **over)
    except ValueError as e:
        # bench sweeps --hot-sizes (the largest stands for them all); demo has --hot-size.
        parser.error(_flag_message(str(e), "--hot-sizes" if "hot_size" in over else "--hot-size"))


def _flag_message(msg: str, hot_flag: str) -> str:
    """An EngineConfig error as ``argument --flag: ...`` naming the flags to change."""
    for product, flags in _ENGINE_PRODUCTS.items():
        if msg.startswith(product + " "):
            a, b = (hot_flag if f == "--hot-size" else f for f in flags)
            return f"argument {a}: {a} * {b}{msg[len(product) :]}"
    for field, flag in _ENGINE_FLAG.items():
        if msg.startswith(field + " "):
            flag = hot_flag if flag == "--hot-size" else flag
            return f"argument {flag}:" + msg[len(field) :]
    return msg
