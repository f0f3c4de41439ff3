"""What each `hisparse` command does once its flags parsed: `info`, `demo`, `bench`, `plan`,
`export-model`. Cross-flag checks that argparse cannot express happen here, before any work;
the work itself lives in hisparse.cli.demo, hisparse.cli.bench (both over hisparse.cli.workload,
on the DSA engine), hisparse.cli.plan and hisparse.models.checkpoint / dsa.random_checkpoint
(export-model), imported only when their command runs (they import torch).
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


#: --hidden is refused unless a multiple of this: 8 bf16/fp16 values make one 16-byte vector
#: word, the unit vLLM's and torch's vectorised kernels load a row in, and every width the docs
#: and tests serve is one.
HIDDEN_MULTIPLE = 8


def check_export_flags(args: argparse.Namespace) -> None:
    """export-model's cross-flag checks (argparse checked each flag's own range), in one line
    naming the flag, before anything is drawn or written."""
    if args.hidden % HIDDEN_MULTIPLE:
        _flag_error("--hidden", f"must be a multiple of {HIDDEN_MULTIPLE}", args.hidden)
    for flag, value, bound, name in (
        ("--index-share", args.index_share, args.layers, "--layers"),
        ("--top-k", args.top_k, args.max_model_len, "--max-model-len"),
        ("--recent-window", args.recent_window, args.top_k, "--top-k"),
    ):
        if value > bound:
            _flag_error(flag, f"must be <= {name} ({bound})", value)


def check_export_size(args: argparse.Namespace, cfg) -> None:
    """The weights must fit on the disk that gets them and, twice (the tensors and the bytes
    written from them), in the RAM available: refused before drawing them."""
    import shutil
    from pathlib import Path

    from hisparse.models.checkpoint import weight_bytes
    from hisparse.runtime.host_pool import available_host_bytes

    need = weight_bytes(cfg)
    out = Path(args.dir).absolute()
    anchor = next((p for p in (out, *out.parents) if p.exists()), out.anchor)
    for room, times, where in (
        (shutil.disk_usage(anchor).free, "", f"free on the disk of {str(anchor)!r}"),
        (available_host_bytes(), " (twice that while written)", "of RAM available"),
    ):
        if need * (2 if times else 1) > room:
            raise CommandError(
                f"argument --hidden: the weights at --hidden {args.hidden}, --layers "
                f"{args.layers}, --vocab {args.vocab}, --max-model-len {args.max_model_len} take "
                f"{need / 2**30:.2f} GiB{times}, more than the {room / 2**30:.2f} GiB {where}",
                2,
            )


def _flag_error(flag: str, rule: str, value) -> None:
    raise CommandError(f"argument {flag}: {rule}, got {value}", 2)


#: export-model flags that shape only the reference model.
_REFERENCE_ONLY = ("hidden", "vocab", "indexer_dim", "index_share", "row_format", "drift")


def _export_dsa(args: argparse.Namespace) -> int:
    """export-model --arch deepseek_v32 / glm_moe_dsa: a seeded tiny checkpoint."""
    for dest in _REFERENCE_ONLY + ("recent_window",):
        value = getattr(args, dest)
        if value != args._parser.get_default(dest):
            rule = f"applies to --arch reference only, not {args.arch}"
            _flag_error("--" + dest.replace("_", "-"), rule, value)
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


def cmd_export_model(args: argparse.Namespace) -> int:
    if args.arch != "reference":
        return _export_dsa(args)
    check_export_flags(args)
    from hisparse.models.checkpoint import ExportError, export_model, model_config

    try:
        cfg = model_config(
            args.max_model_len,
            num_layers=args.layers,
            index_share=args.index_share,
            hidden=args.hidden,
            vocab=args.vocab,
            indexer_dim=args.indexer_dim,
            top_k=args.top_k,
            row_format=args.row_format or "fp8",
            drift=args.drift,
            recent_window=args.recent_window,
            seed=args.seed,
        )
        check_export_size(args, cfg)
        out = export_model(args.dir, cfg, force=args.force)
    except (ExportError, OSError) as e:
        args._parser.error(str(e))
        return 2
    print(
        f"wrote {out}: {cfg.num_layers} layers, top-k {cfg.top_k}, {cfg.row_bytes}-B rows, "
        f"context {cfg.max_context}"
    )
    return 0
