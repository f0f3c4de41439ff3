"""Flag types and shared flag groups of the `hisparse` command line.

The validators are argparse ``type=`` callables: a bad value raises ``ArgumentTypeError`` and
argparse prints one line naming the flag, exit status 2. The workload group is shared by `demo`
and `bench`. Imports no torch (``hisparse --help`` stays fast).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from typing import Callable, Optional, Sequence

from hisparse.cli.errors import CommandError


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


def add_progress_flag(g) -> None:
    """``--no-progress``, shared by the commands that draw progress bars (demo, bench)."""
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def add_workload_flags(
    p: argparse.ArgumentParser, *, requests: int, concurrency: int, prompt_len: int, output_len: int
):
    """The DSA-engine workload of `demo` and `bench` (defaults differ per command); the group,
    for a command's own workload flags."""
    g = p.add_argument_group("workload (DSA engine, hisparse.engine.dsa)")
    g.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the engine runs (default: cpu)",
    )
    g.add_argument(
        "--requests",
        "--prompts",
        type=int_range(1, 4096),
        default=requests,
        help=f"requests in the workload, each a byte-token prompt (default: {requests})",
    )
    g.add_argument(
        "--concurrency",
        type=int_range(1, 4096),
        default=concurrency,
        help=f"max requests decoding in one batch (default: {concurrency})",
    )
    g.add_argument(
        "--prompt-len",
        type=int_range(1, 1 << 20),
        default=prompt_len,
        help=f"prompt tokens per request; request i has 7 x (i mod 4) more (default: {prompt_len})",
    )
    g.add_argument(
        "--output-len",
        "--new-tokens",
        type=int_range(1, 1 << 20),
        default=output_len,
        help=f"greedy tokens generated per request (default: {output_len})",
    )
    g.add_argument(
        "--row-format",
        "--row-layout",
        choices=("fp8", "bf16", "f32"),
        default=None,
        help="latent row bytes: fp8 656 B, bf16 1152 B, f32 2304 B at the released sizes (default: "
        "fp8; bf16 where a --model's kv_lora_rank is not a multiple of 128)",
    )
    g.add_argument(
        "--threads",
        type=int_range(0, 1024),
        default=1,
        help="torch CPU threads for the run; 0 = leave torch's default (default: 1: "
        "the tiny model's ops are small)",
    )
    return g


#: Flags the demo's former engine took and the DSA engine does not: why, for the one line that
#: refuses them (scripts written for the old demo get told, not "unrecognized").
RETIRED = {
    "--recent-window": "the DSA indexer selects every row itself (no recent window)",
    "--metrics-interval": "the DSA engine reports its counters once per run",
    "--binding-fault": "a negative control of the former engine; evals/parity runs the DSA one",
}


def add_retired_flags(p: argparse.ArgumentParser, flags: Sequence[str]) -> None:
    for flag in flags:
        p.add_argument(flag, dest=_retired_dest(flag), default=None, help=argparse.SUPPRESS)


def check_retired(args: argparse.Namespace) -> None:
    """One line for the first retired flag given."""
    for flag, why in RETIRED.items():
        if getattr(args, _retired_dest(flag), None) is not None:
            raise CommandError(
                f"argument {flag}: no longer taken ({why}); the command runs the DSA engine now",
                2,
            )


def _retired_dest(flag: str) -> str:
    return "retired_" + flag.lstrip("-").replace("-", "_")
