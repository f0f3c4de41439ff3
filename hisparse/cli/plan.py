"""`hisparse plan`: its flags, reading them into ``PlanInputs``, and the printed report (the
numbers come from hisparse.cli.capacity)."""

from __future__ import annotations

import json
import os

from hisparse.cli.capacity import (
    DEFAULTS,
    GIB,
    MODEL_FIELDS,
    PRESETS,
    PlanError,
    PlanInputs,
    compute,
)
from hisparse.ops.limits import MAX_HOT_SIZE, ROW_ALIGN


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB"


def render(r: dict) -> str:
    i = r["inputs"]
    mc, st, bpr = r["max_concurrency"], r["decode_step"], r["bytes_per_request"]
    gain = f"{mc['gain']:.1f}x" if mc["gain"] is not None else "n/a (resident fits no request)"
    lines = [
        f"model: {i['layers']} layers, {i['row_bytes']}-B KV rows, top-k {i['top_k']}, "
        f"index share {i['index_share']} ({r['index_groups']} indexers), "
        f"indexer keys {i['indexer_key_bytes']} B/token",
        f"budget per GPU: {i['gpu_mem_gib']:g} GiB GPU for KV, {i['host_mem_gib']:g} GiB host; "
        f"context {i['context']:,} tokens; hot buffer {i['hot_size']} rows; "
        f"miss rate {i['miss_rate']:g}",
        "",
        f"  per request, resident:        {_gib(bpr['resident_device'])} on the GPU",
        f"  per request, HiSparse:        {_gib(bpr['hisparse_device'])} on the GPU + "
        f"{_gib(bpr['hisparse_host'])} host",
        f"  max concurrency, resident:    {mc['resident']:,}",
        f"  max concurrency, HiSparse:    {mc['hisparse']:,}  "
        f"(limited by {mc['hisparse_limited_by']}; "
        f"GPU allows {mc['hisparse_gpu_limit']:,}, host {mc['hisparse_host_limit']:,})",
        f"  gain:                         {gain}",
        f"  host pool at max concurrency: {_gib(r['host_pool_bytes_at_max'])}",
        f"  decode step at batch {st['batch']:,}: {st['h2d_bytes'] / 1e9:,.3f} GB host->device "
        f"= {st['h2d_ms']:,.3f} ms at {st['pcie_gbps']:g} GB/s",
    ]
    hy = r["hybrid"]
    lines += [
        f"  hybrid residency:             all resident up to {hy['spills_above']:,} requests, "
        "spills "
        f"beyond; max concurrency {hy['max_concurrency']:,} (limited by {hy['limited_by']})",
    ]
    if hy["resident"] is not None:
        lines.append(
            f"  hybrid at batch {hy['batch']:,}: {hy['resident']:,} resident + "
            f"{hy['spilled']:,} spilled, host pool {_gib(hy['host_pool_bytes'])}, "
            f"{hy['h2d_bytes'] / 1e9:,.3f} GB host->device "
            f"= {hy['h2d_ms']:,.3f} ms per step"
        )
    else:
        lines.append(f"  hybrid at batch {hy['batch']:,}: does not fit the GPU budget")
    lines += [f"  note: {n}" for n in r["notes"]]
    return "\n".join(lines)


def inputs_from_args(args) -> PlanInputs:
    model = dict(PRESETS[args.preset]) if args.preset else {}
    missing = []
    for f in MODEL_FIELDS:
        v = getattr(args, f)
        if v is not None:
            model[f] = v
        elif f not in model:
            missing.append("--" + f.replace("_", "-"))
    if missing:
        raise PlanError(
            f"argument --preset: give a preset ({', '.join(PRESETS)}) or all of "
            f"{', '.join(missing)}"
        )
    hot = args.hot_size if args.hot_size is not None else 2 * model["top_k"]
    return PlanInputs(
        layers=model["layers"],
        row_bytes=model["row_bytes"],
        top_k=model["top_k"],
        index_share=model["index_share"],
        indexer_key_bytes=model["indexer_key_bytes"],
        gpu_mem_gib=args.gpu_mem_gib,
        host_mem_gib=args.host_mem_gib,
        context=args.context,
        hot_size=hot,
        miss_rate=args.miss_rate,
        pcie_gbps=args.pcie_gbps,
        batch=args.batch,
    )


def add_plan_flags(p, *, int_range, float_range, output_path) -> None:
    """Declare the flags of `hisparse plan` on ``p``; the validators come from the CLI (this
    module does not import it)."""
    _add_model_group(p, int_range)
    _add_deployment_group(p, int_range, float_range)
    p.add_argument(
        "--json",
        type=output_path((".json",)),
        default=None,
        metavar="PATH",
        help="write the results as JSON",
    )


def _add_model_group(p, int_range) -> None:
    m = p.add_argument_group(
        "model (a preset, or every value explicitly; explicit values override the preset)"
    )
    m.add_argument("--preset", choices=tuple(PRESETS), default=None, help="model preset")
    m.add_argument("--layers", type=int_range(1, 100_000), default=None, help="attention layers")
    m.add_argument(
        "--row-bytes",
        type=int_range(ROW_ALIGN, 1 << 20),
        default=None,
        help="KV row bytes per token per layer (656 FP8 MLA, 1152 BF16 MLA; "
        f"multiple of {ROW_ALIGN})",
    )
    m.add_argument(
        "--top-k", type=int_range(1, MAX_HOT_SIZE), default=None, help="tokens selected per step"
    )
    m.add_argument(
        "--index-share",
        type=int_range(1, 100_000),
        default=None,
        help="layers per index group (leader + followers)",
    )
    m.add_argument(
        "--indexer-key-bytes",
        type=int_range(0, 1 << 20),
        default=None,
        help="indexer key bytes per token per index group (stay on the GPU)",
    )


def _add_deployment_group(p, int_range, float_range) -> None:
    d = p.add_argument_group("deployment")
    d.add_argument(
        "--gpu-mem-gib",
        type=float_range(0.0, 1e6, lo_open=True),
        default=DEFAULTS["gpu_mem_gib"],
        help="GPU memory for KV per GPU, after weights and activations "
        f"(default: {DEFAULTS['gpu_mem_gib']:g})",
    )
    d.add_argument(
        "--host-mem-gib",
        type=float_range(0.0, 1e7),
        default=DEFAULTS["host_mem_gib"],
        help=f"pinned host memory for the pool per GPU (default: {DEFAULTS['host_mem_gib']:g})",
    )
    d.add_argument(
        "--context",
        type=int_range(1, 1 << 30),
        default=DEFAULTS["context"],
        help=f"tokens per request, prompt + output (default: {DEFAULTS['context']})",
    )
    d.add_argument(
        "--hot-size",
        type=int_range(1, MAX_HOT_SIZE),
        default=None,
        help="hot-buffer rows per request per layer (default: 2 x top-k)",
    )
    d.add_argument(
        "--miss-rate",
        type=float_range(0.0, 1.0),
        default=DEFAULTS["miss_rate"],
        help=f"fraction of top-k lookups that miss per step (default: {DEFAULTS['miss_rate']:g})",
    )
    d.add_argument(
        "--pcie-gbps",
        type=float_range(0.0, 1e5, lo_open=True),
        default=DEFAULTS["pcie_gbps"],
        help=f"host->device gather bandwidth, GB/s (default: {DEFAULTS['pcie_gbps']:g}, "
        "an H200's zero-copy gather of 656-B rows)",
    )
    d.add_argument(
        "--batch",
        type=int_range(1, 1 << 30),
        default=None,
        help="decode batch for the per-step traffic (default: HiSparse max concurrency)",
    )


def main(args) -> int:
    r = compute(inputs_from_args(args))
    print(render(r))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0
