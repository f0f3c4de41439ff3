"""`hisparse plan`: its flags, reading them into ``PlanInputs``, and the printed report (the
per-GPU numbers come from hisparse.cli.capacity; a config.json and the deployment figures from
hisparse.cli.plan_model)."""

from __future__ import annotations

import json
import math
import os
from typing import List, Optional

from hisparse.cli import plan_model
from hisparse.cli.capacity import (
    DEFAULTS,
    GIB,
    MODEL_FIELDS,
    PRESETS,
    PlanError,
    PlanInputs,
)
from hisparse.ops.limits import MAX_HOT_SIZE, ROW_ALIGN, default_hot_size


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
        f"budget: {i['gpu_mem_gib']:g} GiB for KV per GPU, {i['host_mem_gib']:g} GiB host per "
        f"pool; "
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
        f"= {st['h2d_ms']:,.3f} ms of copy added to the step at {st['pcie_gbps']:g} GB/s",
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


def render_deployment(r: dict, model: Optional[dict] = None) -> List[str]:
    """The deployment section of the report, after ``render``'s per-GPU one."""
    d, i = r["deployment"], r["inputs"]
    ranks = d["attention_ranks"]
    lines = [""]
    if model is not None:
        pc = model["params"]
        w, kv = model["weights_gb_per_gpu"], i["gpu_mem_gib"] * GIB / 1e9
        dtype = "FP8" if pc["fp8_weights"] else "BF16"
        lines += [
            f"  model: {model['source']} ({model['arch']}): {pc['total'] / 1e9:,.1f} B parameters "
            f"({pc['with_mtp'] / 1e9:,.1f} B with the MTP layers)",
            f"  weights per GPU:              ~{w:,.1f} GB ({dtype} layers) + {kv:,.1f} GB KV "
            f"budget = {w + kv:,.1f} GB, before activations",
        ]
    hs_lo, hs_hi = d["tokens_per_s_hisparse_range"]
    cp_lo, cp_hi = d["copy_ms_range"]
    lines += [
        f"  deployment: {d['gpus']} GPU(s), TP {d['tp']}, {ranks} attention rank(s); "
        f"{i['context']:,} tokens per request",
        f"  requests that fit, all ranks: resident {d['requests_resident']:,}, "
        f"HiSparse {d['requests_hisparse']:,}",
        f"  host RAM for the pools:       {d['host_pools']} x "
        f"{d['host_pool_bytes_each'] / GIB:,.1f} GiB = "
        f"{d['host_pool_bytes_total'] / GIB:,.1f} GiB pinned",
        f"  PCIe per decode step:         {d['h2d_bytes_per_gpu'] / 1e9:,.3f} GB per GPU "
        f"({d['h2d_bytes_all_gpus'] / 1e9:,.2f} GB over all GPUs), copy "
        f"{_span(cp_lo, cp_hi)} ms added to the step",
        f"  tokens/s estimate, all ranks: resident {d['tokens_per_s_resident']:,.0f} "
        f"(batch {d['resident_batch']:,} per rank), HiSparse {_span(hs_lo, hs_hi, 0)} "
        f"(batch {r['decode_step']['batch']:,} per rank)",
    ]
    return lines + [f"  regime: {x}" for x in d["regime"]]


def _span(a: float, b: float, digits: int = 2) -> str:
    if math.isclose(a, b):
        return f"{a:,.{digits}f}"
    return f"{a:,.{digits}f}-{b:,.{digits}f}"


def _model_of(args):
    """(model fields, the config's model dict or None)."""
    if args.model is None and args.config is None:
        return (dict(PRESETS[args.preset]) if args.preset else {}), None
    cfg = plan_model.model_from_config(*plan_model.read_config(args.model, args.config))
    w = plan_model.weight_bytes_per_gpu(cfg["params"], args.gpus, args.tp)
    cfg["weights_gb_per_gpu"] = w / 1e9
    return {f: cfg[f] for f in MODEL_FIELDS}, cfg


def inputs_from_args(args):
    """(PlanInputs, layers per index group, the config's model dict or None)."""
    model, cfg = _model_of(args)
    missing = []
    for f in MODEL_FIELDS:
        v = getattr(args, f)
        if v is not None:
            model[f] = v
        elif f not in model:
            missing.append("--" + f.replace("_", "-"))
    if missing:
        raise PlanError(
            f"argument --preset: give a preset ({', '.join(PRESETS)}), --model DIR or "
            f"--config FILE, or all of {', '.join(missing)}"
        )
    L, s = model["layers"], model["index_share"]
    groups = [s] * (L // s) + ([L % s] if L % s else [])
    if cfg is not None and args.layers is None and args.index_share is None:
        groups = cfg["group_sizes"]  # uneven groups: the config's own indexer_types
    hot = args.hot_size if args.hot_size is not None else default_hot_size(model["top_k"])
    p = PlanInputs(
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
        # without --pcie-gbps, plan_model.plan() replaces this with the layout's measured rate
        pcie_gbps=args.pcie_gbps or DEFAULTS["pcie_gbps"],
        batch=args.batch,
        index_groups=len(groups),
    )
    return p, groups, cfg


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
        "model (a preset, a config.json, or every value explicitly; explicit values override)"
    )
    src = m.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=tuple(PRESETS), default=None, help="model preset")
    src.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="a checkpoint directory: its config.json gives the model (DeepSeek-V3.2, GLM-5)",
    )
    src.add_argument(
        "--config", metavar="FILE", default=None, help="a config.json file, as --model reads it"
    )
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
        help="pinned host memory per host pool: one pool per GPU with DP attention, one per "
        f"TP group (default: {DEFAULTS['host_mem_gib']:g})",
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
        default=None,
        help="host->device gather rate per GPU, GB/s (default: measured on an H200 and an H100 "
        "for the pool's size and layout: 44-48 from a pool of at most 4.5 GiB, falling to 14-18 "
        "at 32 GiB and beyond for one-layer index groups; 46-49 for co-located groups of 4)",
    )
    d.add_argument(
        "--gpus", type=int_range(1, 1 << 16), default=1, help="GPUs in the deployment (default: 1)"
    )
    d.add_argument(
        "--tp",
        type=int_range(1, 1 << 16),
        default=1,
        help="tensor-parallel size of attention; 1 (default) = DP attention, each GPU its own "
        "requests and host pool; must divide --gpus",
    )
    d.add_argument(
        "--batch",
        type=int_range(1, 1 << 30),
        default=None,
        help="decode batch for the per-step traffic (default: HiSparse max concurrency)",
    )


def main(args) -> int:
    p, groups, cfg = inputs_from_args(args)
    r = plan_model.plan(p, groups, args.gpus, args.tp, args.pcie_gbps is not None)
    if cfg is not None:
        r["model"] = cfg
    print("\n".join([render(r), *render_deployment(r, cfg)]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0
