"""The `hisparse` command line: `info`, `demo`, `bench`, `plan`.

Each command's logic lives in its own module (hisparse.demo, hisparse.bench, hisparse.plan);
this file only declares and validates flags. Every bad value exits with status 2 and one line
naming the flag.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
from typing import Callable, Optional, Sequence

from hisparse import __version__
from hisparse.limits import MAX_HOT_SIZE


class CommandError(Exception):
    """A problem found while running a command: one line on stderr, prefixed with the
    command's name, and exit status ``code`` (2 for a bad flag value, as argparse does)."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (`hisparse demo: error: ...`), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


# ---- flag validators (argparse `type=`): ValueError/ArgumentTypeError -> one-line error -------


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


# ---- info --------------------------------------------------------------------------------


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
            lines.append(
                (
                    f"GPU {i}",
                    f"{p.name}, {p.total_memory / 2**30:.0f} GiB, "
                    f"sm_{p.major}{p.minor}, {p.multi_processor_count} SMs",
                )
            )
    else:
        lines.append(("GPU", "none visible"))
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        print(f"{k:<{width}}  {v}")
    return 0


# ---- demo / bench share the workload flags -------------------------------------------------

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
    "row_layout": "--row-layout",
}


def _add_model_flags(g, *, layers: int) -> None:
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
        "--row-layout",
        choices=("fp8", "bf16"),
        default="fp8",
        help="KV row layout: fp8 = 656-B rows, bf16 = 1152-B rows (default: fp8)",
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


def _add_workload_flags(
    p: argparse.ArgumentParser,
    *,
    requests: int,
    concurrency: int,
    prompt_len: int,
    output_len: int,
    hot_size: bool = True,
) -> None:
    g = p.add_argument_group("workload (reference engine)")
    g.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the engine runs (default: cpu)",
    )
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
    _add_model_flags(g, layers=4)
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


def check_engine_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, **over):
    """Build the EngineConfig; a cross-flag problem becomes one line naming the flags."""
    from hisparse.demo import engine_config_from_args

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
        msg = str(e)
        for field, flag in _ENGINE_FLAG.items():
            if msg.startswith(field + " "):
                msg = f"argument {flag}:" + msg[len(field) :]
                break
        parser.error(msg)


def _require_backend(device: str) -> None:
    """The kernels for ``device`` must be built (a source tree without a build has none)."""
    import torch

    from hisparse import _ext

    if device == "cuda" and not torch.cuda.is_available():
        raise CommandError("argument --device: torch sees no CUDA GPU (use --device cpu)", 2)
    try:
        _ext.require(device)
    except _ext.BackendUnavailableError as e:
        raise CommandError(str(e)) from None


def _demo(args: argparse.Namespace) -> int:
    cfg = check_engine_flags(args._parser, args)
    _require_backend(args.device)
    from hisparse import demo

    demo.check_memory(cfg, args.device)
    return demo.main(args)


def _bench(args: argparse.Namespace) -> int:
    check_engine_flags(args._parser, args, hot_size=max(args.hot_sizes + [args.top_k]))
    bad = [h for h in args.hot_sizes if h < args.top_k]
    if bad:
        args._parser.error(
            f"argument --hot-sizes: every size must be >= --top-k ({args.top_k}), got {bad}"
        )
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            args._parser.error(
                "argument --plot: needs matplotlib, which is not installed "
                "(pip install 'hisparse[plot]')"
            )
    _require_backend(args.device)
    from hisparse import bench

    return bench.main(args)


def _plan(args: argparse.Namespace) -> int:
    from hisparse import plan

    try:
        return plan.main(args)
    except plan.PlanError as e:
        args._parser.error(str(e))
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hisparse",
        description="HiSparse hot-buffering for sparse-attention inference.",
    )
    parser.add_argument("--version", action="version", version=f"hisparse {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", help="print the version, torch, built backends and GPUs")
    p.set_defaults(func=_info)

    p = sub.add_parser(
        "demo",
        help="run one workload resident vs HiSparse and check bit-exact parity",
        description="Run one workload on the reference sparse-MLA engine twice: every KV row on "
        "the device, then HiSparse (host pool + small hot buffers). Prints a summary; "
        "exits 1 if tokens or final hidden states differ.",
    )
    _add_workload_flags(p, requests=32, concurrency=8, prompt_len=512, output_len=96)
    o = p.add_argument_group("output")
    o.add_argument(
        "--metrics-port",
        type=port,
        default=None,
        help="serve Prometheus /metrics on this port during the run (0 = any free port)",
    )
    o.add_argument(
        "--json",
        type=output_path((".json",)),
        default=None,
        metavar="PATH",
        help="write the summary as JSON",
    )
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    o.add_argument(
        "--binding-fault",
        choices=("base_offset",),
        default=None,
        help="negative control: bind every layer of the HiSparse run at the allocation's "
        "base offset (the upstream bug); parity must then FAIL",
    )
    p.set_defaults(func=_demo, _parser=p)

    p = sub.add_parser(
        "bench",
        help="op micro-benchmarks and hit rate vs hot-buffer size",
        description="Micro-benchmarks of resolve/gather, then a sweep of hit rate against "
        "hot-buffer size on the reference workload (HiSparse mode).",
    )
    _add_workload_flags(
        p, requests=12, concurrency=4, prompt_len=256, output_len=32, hot_size=False
    )
    b = p.add_argument_group("bench")
    b.add_argument(
        "--hot-sizes",
        type=int_list(1, MAX_HOT_SIZE),
        default=None,
        metavar="H1,H2,...",
        help="hot-buffer sizes to sweep, each >= --top-k (default: 1, 1.25, 1.5, 2, 3, 4 x top-k)",
    )
    b.add_argument("--skip-ops", action="store_true", help="skip the op micro-benchmarks")
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
    p.set_defaults(func=_bench, _parser=p)

    p = sub.add_parser(
        "plan",
        help="capacity calculator: concurrency with and without HiSparse, host pool, PCIe",
        description="Size a deployment: max concurrent requests with and without HiSparse, the "
        "host pool they need, and host->device traffic per decode step. Formulas: docs/plan.md.",
    )
    from hisparse.plan import add_plan_flags

    add_plan_flags(p, int_range=int_range, float_range=float_range, output_path=output_path)
    p.set_defaults(func=_plan, _parser=p)

    p = sub.add_parser(
        "export-model",
        help="write the reference sparse-MLA model as a directory vLLM serves",
        description="Write config.json, model.safetensors (seeded weights) and a byte-level "
        "tokenizer into DIR, for `python -m vllm.entrypoints.openai.api_server "
        "--model DIR` (with or without the HiSparse connector). No network needed.",
    )
    p.add_argument("dir", metavar="DIR", help="output directory (created if missing)")
    m = p.add_argument_group("model")
    _add_model_flags(m, layers=2)
    m.add_argument(
        "--hidden", type=int_range(1, 65536), default=64, help="residual width (default: 64)"
    )
    m.add_argument(
        "--vocab",
        type=int_range(257, 1 << 20),
        default=512,
        help="vocabulary, >= 257: 256 byte tokens + end-of-text (default: 512)",
    )
    m.add_argument(
        "--indexer-dim",
        type=int_range(1, 4096),
        default=32,
        help="indexer key/query width (default: 32)",
    )
    m.add_argument(
        "--max-model-len",
        type=int_range(2, 1 << 20),
        default=2048,
        help="longest context in tokens (default: 2048)",
    )
    p.set_defaults(func=_export_model, _parser=p)
    return parser


def _export_model(args: argparse.Namespace) -> int:
    from hisparse.model_export import ExportError, export_model, model_config

    try:
        cfg = model_config(
            args.max_model_len,
            num_layers=args.layers,
            index_share=args.index_share,
            hidden=args.hidden,
            vocab=args.vocab,
            indexer_dim=args.indexer_dim,
            top_k=args.top_k,
            row_layout=args.row_layout,
            drift=args.drift,
            recent_window=args.recent_window,
            seed=args.seed,
        )
        if args.index_share > args.layers:
            raise ExportError(
                f"--index-share ({args.index_share}) must be <= --layers ({args.layers})"
            )
        out = export_model(args.dir, cfg)
    except (ExportError, OSError) as e:
        args._parser.error(str(e))
        return 2
    print(
        f"wrote {out}: {cfg.num_layers} layers, top-k {cfg.top_k}, {cfg.row_bytes}-B rows, "
        f"context {cfg.max_context}"
    )
    return 0


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
    if getattr(args, "command", None) == "bench" and args.hot_sizes is None:
        k = args.top_k
        args.hot_sizes = sorted({k, int(1.25 * k), int(1.5 * k), 2 * k, 3 * k, 4 * k} - {0})
        args.hot_sizes = [h for h in args.hot_sizes if h <= MAX_HOT_SIZE]
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
