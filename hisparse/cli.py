"""The `hisparse` command line: `hisparse info` and the subcommands other modules add."""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Callable, Optional, Sequence

from hisparse import __version__


def _info(args: argparse.Namespace) -> int:
    import torch

    from hisparse import _ext

    backends = _ext.built_backends()
    lines = [
        ("hisparse", __version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("torch CUDA", torch.version.cuda or "none (CPU build)"),
        ("backends built", ", ".join(backends) if backends else f"none: {_ext.BUILD_HINT}"),
    ]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append((f"GPU {i}", f"{p.name}, {p.total_memory / 2**30:.0f} GiB, "
                                      f"sm_{p.major}{p.minor}, {p.multi_processor_count} SMs"))
    else:
        lines.append(("GPU", "none visible"))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hisparse",
        description="HiSparse hot-buffering for sparse-attention inference.",
    )
    parser.add_argument("--version", action="version", version=f"hisparse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", help="print the version, torch, built backends and GPUs")
    p.set_defaults(func=_info)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Optional[Callable[[argparse.Namespace], int]] = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
