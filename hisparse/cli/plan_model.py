"""`hisparse plan --model DIR` / `--config FILE` and the deployment figures of every plan.

* A DeepSeek-V3.2 / GLM-5 config.json read with the project's own reader (``DSAConfig``,
  ``DecoderSpec``) into the planner's model fields, and the parameter count by tensor shapes.
  The models package imports torch, so it is imported only when a config is read.
* The per-GPU plan of hisparse.cli.capacity spread over ``--gpus`` with ``--tp`` or DP attention,
  the host->device rate the pool's layout gets, and a tokens/s estimate; every figure comes with
  the regime it holds in (``regime`` lines).

Formulas and sources: docs/plan.md, "Model from a config.json" and "Deployment".
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import List, Sequence, Tuple

from hisparse.cli.capacity import GIB, PlanError, PlanInputs, compute
from hisparse.cli.copy_rate import WINDOW_BYTES, gather_gbps


def read_config(model_dir, config_file) -> Tuple[dict, str, str]:
    """(config dict, the flag it came from, its path); every problem is one PlanError line
    naming the flag."""
    if model_dir is not None:
        flag = "--model"
        if not os.path.isdir(model_dir):
            raise PlanError(f"argument --model: {model_dir}: no such directory")
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise PlanError(f"argument --model: {model_dir} has no config.json")
    else:
        flag, path = "--config", config_file
        if not os.path.isfile(path):
            raise PlanError(f"argument --config: {path}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise PlanError(f"argument {flag}: {path} is not readable JSON ({first})") from None
    if not isinstance(hf, dict):
        raise PlanError(f"argument {flag}: {path} is not a JSON object")
    return hf, flag, path


def _group_sizes(types) -> List[int]:
    """Layers per index group: a "full" layer and the "shared" layers after it."""
    sizes: List[int] = []
    for t in types:
        if t == "full":
            sizes.append(1)
        else:
            sizes[-1] += 1
    return sizes


def model_from_config(hf: dict, flag: str, path: str) -> dict:
    """The planner's model fields, the index groups and the parameter count of one config."""
    from hisparse.models.dsa import index_keys
    from hisparse.models.dsa.config import DSAConfig
    from hisparse.models.dsa.decoder import DecoderSpec
    from hisparse.models.rows import fits

    try:
        cfg = DSAConfig.from_hf(hf)
        spec = DecoderSpec.from_hf(hf, cfg)
        params = param_count(hf, cfg, spec)
        # The config's hisparse_row_format; else FP8, as DeepSeek-V3.2 serves, where it fits.
        fmt = cfg.row_format or ("fp8" if fits("fp8", cfg.kv_lora_rank) else "bf16")
        key_fmt = hf.get("hisparse_key_format") or index_keys.default_format(fmt)
        key_bytes = index_keys.key_bytes(key_fmt, cfg.index_head_dim)
    except (ValueError, TypeError, KeyError) as e:  # DSAConfigError is a ValueError
        msg = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        msg = msg.removeprefix("config.json: ")  # the path is already named
        raise PlanError(f"argument {flag}: {path}: {msg}") from None
    groups = _group_sizes(cfg.indexer_types)
    return {
        "source": path,
        "arch": cfg.arch,
        "layers": cfg.num_layers,
        "row_bytes": cfg.row_bytes(fmt),
        "row_format": fmt,
        "top_k": cfg.index_topk,
        "index_share": max(groups),
        "index_groups": len(groups),
        "group_sizes": groups,
        "indexer_key_bytes": key_bytes,
        "params": params,
    }


def _need(hf: dict, name: str) -> int:
    v = hf.get(name)
    if v is None:
        raise ValueError(f"config.json lacks {name!r}, which the parameter count needs")
    return int(v)


def param_count(hf: dict, cfg, spec) -> dict:
    """Parameters by the tensor shapes transformers gives the model (the names of
    hisparse.models.dsa.weights): embedding; per layer two RMSNorms, MLA (q_a, its norm, q_b,
    kv_a, its norm, kv_b, o), the indexer on "full" layers (wq_b, wk, k_norm weight and bias,
    weights_proj), and a dense MLP or the MoE (routed + shared experts, router, correction
    bias); the final norm; the LM head unless tied. ``with_mtp`` adds the next-token-prediction
    layers as DeepSeek-V3 stores them (one MoE layer, eh_proj, three norms and their own copies
    of the embedding and head): published totals leave them out."""
    h, qr, heads = cfg.hidden_size, cfg.q_lora_rank, cfg.num_heads
    nope, v, c, r = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    mla = h * qr + qr + qr * heads * (nope + r) + h * (c + r) + c
    mla += c * heads * (nope + v) + heads * v * h
    d, ih = cfg.index_head_dim, cfg.index_n_heads
    indexer = qr * ih * d + h * d + 2 * d + h * ih
    e = spec.n_experts
    dense_mlp = 3 * h * _need(hf, "intermediate_size") if any(spec.dense) else 0
    moe = 0
    if not all(spec.dense):
        experts = e + _need(hf, "n_shared_experts")
        moe = 3 * h * _need(hf, "moe_intermediate_size") * experts + e * h + e
    attention = experts_total = dense_total = 0
    for i in range(cfg.num_layers):
        attention += 2 * h + mla + (indexer if cfg.is_full(i) else 0)
        if spec.dense[i]:
            dense_total += dense_mlp
        else:
            experts_total += moe
    embed = spec.vocab_size * h
    embed_head = embed if spec.tie_embeddings else 2 * embed
    total = attention + dense_total + experts_total + embed_head + h
    n_mtp = int(hf.get("num_nextn_predict_layers") or 0)
    mtp = n_mtp * (3 * h + 2 * h * h + 2 * h + mla + indexer + moe + 2 * embed)
    return {
        "total": total,
        "with_mtp": total + mtp,
        "attention": attention,  # MLA + indexers + the layers' norms
        "dense_mlp": dense_total,
        "experts": experts_total,  # routed + shared experts, routers, correction biases
        "embed_head": embed_head + h,
        "fp8_weights": (hf.get("quantization_config") or {}).get("quant_method") == "fp8",
    }


def weight_bytes_per_gpu(params: dict, gpus: int, tp: int) -> float:
    """Approximate weight bytes on one GPU: the attention, dense MLPs, embedding and head split
    over the TP degree (replicated across DP-attention ranks), the experts over every GPU
    (expert parallel). FP8 checkpoints: 1 B per layer parameter; embedding and head BF16."""
    per = 1 if params["fp8_weights"] else 2
    shared = (params["attention"] + params["dense_mlp"]) * per + params["embed_head"] * 2
    return shared / tp + params["experts"] * per / gpus


# Decode step of the DSA core on one H200 (bench_decode_tpot.py: 8 layers of DeepSeek-V3.2
# attention through hisparse.engine.graph, dense 18432 MLP, LM head, hot buffer 4096, resident
# rows; engine_tpot_h200.json, engine_tpot_h200_ctx*.json): context -> ((batch, ms/step),
# (batch, ms/step)), batch 1 and the largest batch measured.
PROXY_LAYERS = 8
STEP_MS = {
    32768: ((1, 4.481), (112, 10.539)),
    65536: ((1, 4.515), (69, 9.746)),
    131072: ((1, 4.603), (39, 8.976)),
}


def step_cost(context: int) -> Tuple[float, float]:
    """(b, c): the proxy's fixed ms per step and its us per request per layer at ``context``,
    the line through the two measured batches, interpolated linearly between the measured
    contexts (extrapolated from the nearest two outside them)."""
    pts = []
    for t, ((n1, y1), (n2, y2)) in sorted(STEP_MS.items()):
        c_ms = (y2 - y1) / ((n2 - n1) * PROXY_LAYERS)
        pts.append((t, y1 - n1 * PROXY_LAYERS * c_ms, c_ms * 1e3))
    lo, hi = (pts[0], pts[1]) if context <= pts[1][0] else (pts[-2], pts[-1])
    f = (context - lo[0]) / (hi[0] - lo[0])
    b, c = lo[1] + f * (hi[1] - lo[1]), lo[2] + f * (hi[2] - lo[2])
    return b, max(c, 0.0)


def plan(p: PlanInputs, group_sizes: Sequence[int], gpus: int, tp: int, pcie_given: bool):
    """capacity.compute() at the rate the layout gets (two passes: the rate depends on the pool
    the batch fills), plus the ``deployment`` section."""
    if gpus % tp:
        raise PlanError(f"argument --tp: must divide --gpus ({gpus}), got {tp}")
    r = compute(p)
    pool = r["decode_step"]["host_pool_bytes"]
    lo, hi, layout = (p.pcie_gbps, p.pcie_gbps, "given by --pcie-gbps")
    if not pcie_given:
        lo, hi, layout = gather_gbps(group_sizes, pool)
        r = compute(replace(p, pcie_gbps=lo))
    r["deployment"] = _deployment(r, p, gpus, tp, (lo, hi, layout))
    return r


def _deployment(r: dict, p: PlanInputs, gpus: int, tp: int, rate) -> dict:
    ranks, (lo, hi, layout) = gpus // tp, rate
    mc, st = r["max_concurrency"], r["decode_step"]
    copy_ms = (st["h2d_bytes"] / (hi * 1e9) * 1e3, st["h2d_bytes"] / (lo * 1e9) * 1e3)
    b8, c_us = step_cost(p.context)
    b = b8 * p.layers / PROXY_LAYERS / tp
    c = c_us * p.layers / 1e3  # ms per request per step

    def tps(n: int, extra: float = 0.0) -> float:
        return n / (b + n * c + extra) * 1e3 if n else 0.0

    n_res = mc["resident"] if p.batch is None else min(mc["resident"], p.batch)
    hs = [tps(st["batch"], copy_ms[1]), tps(st["batch"], copy_ms[0])]
    return {
        "gpus": gpus,
        "tp": tp,
        "attention_ranks": ranks,
        "requests_resident": mc["resident"] * ranks,
        "requests_hisparse": mc["hisparse"] * ranks,
        "host_pools": ranks,
        "host_pool_bytes_each": r["host_pool_bytes_at_max"],
        "host_pool_bytes_total": r["host_pool_bytes_at_max"] * ranks,
        "pcie_gbps_range": [lo, hi],
        "pcie_layout": layout,
        "h2d_bytes_per_gpu": st["h2d_bytes"],
        "h2d_bytes_all_gpus": st["h2d_bytes"] * gpus,  # every TP rank copies the misses
        "copy_ms_range": list(copy_ms),
        "step_b_ms": b,
        "step_c_ms_per_request": c,
        "proxy_b_ms": b8,
        "proxy_c_us": c_us,
        "tokens_per_s_resident": tps(n_res) * ranks,
        "resident_batch": n_res,
        "tokens_per_s_hisparse_range": [x * ranks for x in hs],
        "regime": _regime(p, gpus, tp, rate, b8, c_us),
    }


def _regime(p: PlanInputs, gpus: int, tp: int, rate, b8: float, c_us: float) -> List[str]:
    ranks, (lo, hi, layout) = gpus // tp, rate
    lines = [
        f"budget: --gpu-mem-gib {p.gpu_mem_gib:g} GiB of KV per GPU; --host-mem-gib "
        f"{p.host_mem_gib:g} GiB pinned per host pool (one pool per attention rank); per-rank "
        f"figures are one attention rank's, totals are over all {gpus} GPU(s)",
    ]
    if tp > 1:
        lines.append(
            f"attention: TP {tp} ({ranks} rank(s) of {tp} GPUs): MLA rows are replicated, so "
            "each GPU holds every layer's rows of all its rank's requests; the rank's GPUs "
            "share one host pool and each copies the misses over its own link (their contention "
            "for the host's memory is not modelled)"
        )
    else:
        lines.append(
            f"attention: DP attention over {gpus} GPU(s) (--tp 1): each GPU serves its own "
            f"requests from its own host pool ({gpus} pool(s))"
        )
    rate_text = f"{lo:g} GB/s" if lo == hi else f"{lo:.1f}-{hi:.1f} GB/s"
    src = "" if layout.startswith("given") else " (measured on an H200 and an H100: docs/plan.md)"
    lines += [
        f"PCIe: {rate_text} per GPU, {layout}{src}; ~45 GB/s holds only for pools of at most "
        f"{WINDOW_BYTES / GIB:.1f} GiB",
        "copy: not hidden: from 16 requests the row read fetches the misses itself, which added "
        "about their PCIe time alone at 32k on the H200, half what gathering them first added "
        "(docs/results.md); the tokens/s estimate adds the whole copy to the step; it is not a "
        "time per token",
        f"tokens/s: n / (b + n*c + copy) per rank; b = {b8:.2f} ms x {p.layers}/{PROXY_LAYERS} "
        f"layers / TP {tp}, c = {c_us:.2f} us per request-layer at {p.context:,} tokens, "
        "measured on one H200 for the DSA core (8 layers of DeepSeek-V3.2 attention, "
        "dense MLP); an estimate: MoE expert reads, collectives and prefill not modelled",
    ]
    lo_t, hi_t = min(STEP_MS), max(STEP_MS)
    if not lo_t <= p.context <= hi_t:
        lines.append(
            f"tokens/s: {p.context:,} tokens is outside the measured {lo_t:,}-{hi_t:,}; b and c "
            "are extrapolated"
        )
    return lines
