"""What each `hisparse` command does once its flags parsed: `info`, `demo`, `bench`, `plan`,
`export-model`. Cross-flag checks that argparse cannot express happen here, before any work;
the work itself lives in hisparse.cli.demo, hisparse.cli.bench (both over hisparse.cli.workload,
on the DSA engine), hisparse.cli.plan and hisparse.models.dsa.random_checkpoint (export-model),
imported only when their command runs (they import torch).
"""

from __future__ import annotations

import argparse
import platform

from hisparse import __version__
from hisparse.cli.errors import CommandError


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    from hisparse.ops import extension as _ext

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


def _require_backend(device: str) -> None:
    """The kernels for ``device`` must be built (a source tree without a build has none)."""
    import torch

    from hisparse.ops import extension as _ext

    if device == "cuda" and not torch.cuda.is_available():
        raise CommandError("argument --device: torch sees no CUDA GPU (use --device cpu)", 2)
    try:
        _ext.require(device)
    except _ext.BackendUnavailableError as e:
        raise CommandError(str(e)) from None


def cmd_demo(args: argparse.Namespace) -> int:
    _require_backend(args.device)
    from hisparse.cli import demo

    return demo.run_demo(args, demo.plan(args)).exit_code


def cmd_bench(args: argparse.Namespace) -> int:
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            args._parser.error(
                "argument --plot: needs matplotlib, which is not installed "
                "(pip install 'hisparse[plot]')"
            )
    _require_backend(args.device)
    from hisparse.cli import workload

    p = workload.plan(args, hot_flag="--hot-sizes", hot_sizes=args.hot_sizes, resident=False)
    from hisparse.cli import bench

    return bench.main(args, p)


def cmd_plan(args: argparse.Namespace) -> int:
    from hisparse.cli import plan

    try:
        return plan.main(args)
    except plan.PlanError as e:
        args._parser.error(str(e))
        return 2


def _flag_error(flag: str, rule: str, value) -> None:
    raise CommandError(f"argument {flag}: {rule}, got {value}", 2)


def cmd_export_model(args: argparse.Namespace) -> int:
    """A seeded tiny DeepSeek-V3.2 / GLM-5 checkpoint, swapped in as DIR whole."""
    if args.top_k > args.max_model_len:
        _flag_error("--top-k", f"must be <= --max-model-len ({args.max_model_len})", args.top_k)
    from hisparse.models.dsa.random_checkpoint import ARCH_NAMES, export_random_checkpoint
    from hisparse.models.export_dir import ExportError

    try:
        out = export_random_checkpoint(
            args.dir,
            args.arch,
            seed=args.seed,
            force=args.force,
            num_hidden_layers=args.layers,
            index_topk=args.top_k,
            max_position_embeddings=args.max_model_len,
        )
    except (ExportError, OSError) as e:
        args._parser.error(str(e))
        return 2
    cls = "HiSparse" + ARCH_NAMES[args.arch]
    print(
        f"wrote {out}: {ARCH_NAMES[args.arch]}, {args.layers} layers, index top-k {args.top_k}, "
        f"context {args.max_model_len}; serve it with --hf-overrides "
        f'\'{{"architectures": ["{cls}"]}}\''
    )
    return 0
