"""Time per decode step of the code the vLLM classes run (``hisparse.models.dsa.core`` through
``hisparse.engine.graph``), resident against HiSparse, on a GPU at DeepSeek-V3.2's shapes:
hidden 7168, q_lora 1536, 128 heads, kv_lora 512 + rope 64 in 656-byte FP8 rows, indexer 64 x
128 over 132-byte FP8 keys, top-k 2048, an LM head of 129,280. The MoE is stood in by a dense
SwiGLU of its active width per token (8 routed + 1 shared expert x 2048 = 18432), so each layer
does the same matrix work per token. Weights are random bf16.

A step of ``--layers`` layers is captured as one CUDA graph per mode and replayed; the modes
interleave, ``--rounds`` rounds of ``--steps`` replays, the ratio taken within each round; both
modes' tokens and hidden states are compared bit for bit. About ``--miss`` of each request's
top-k is new each step (``hisparse.engine.graph.drift``); the hit rate is read from the resolve
op's counters. ``--capacity`` adds each mode at the most requests a 45 GiB KV budget over
DeepSeek-V3.2's 61 layers holds (``MemoryBudget``) and the tokens/s ratio.

    python benchmarks/bench_decode_tpot.py --capacity \
        --json benchmarks/results/engine_tpot_h200.json
    python benchmarks/bench_decode_tpot.py --context 131072 --batches "" --capacity --json ...
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

from hisparse.engine.graph import MODES, CoreStep, GraphConfig, MemoryBudget, measure
from hisparse.models.dsa.core import ATTENTION, INDEXER, MISSES, SparseMLACore

CORE = SparseMLACore.__module__  # what CoreStep's layers run (checked in run())


def _config(args) -> GraphConfig:
    return GraphConfig.deepseek_v32(
        ctx_len=args.context, hot_size=args.hot_size, layers=args.layers
    )


def _step(args, batch: int, modes) -> CoreStep:
    return CoreStep(
        _config(args), batch, modes, "cuda", attention=args.attention, misses=args.misses,
        indexer=args.indexer, miss=args.miss,
    )  # fmt: skip


def run(args, batch: int, modes, resident_limit: int) -> dict:
    step = _step(args, batch, modes)
    assert type(step.core) is SparseMLACore and step.core.kernel_rows and step.core.kernel_index
    row = measure(step, args.rounds, args.steps)
    row["fits_resident_budget"] = batch <= resident_limit
    row["attention"] = step.core.attention  # what "auto" chose
    row["indexer"] = step.core.indexer
    if "hisparse" in modes:  # where the misses reached the row read at this batch
        row["misses_read"] = "in_read" if step.core.reads_misses(batch) else "gather"
    del step
    torch.cuda.empty_cache()
    return row


def profile(args, batch: int, top: int) -> None:
    """GPU time per eager step and layer by kernel and by the torch op that launched it."""
    from torch.profiler import ProfilerActivity, profile

    step = _step(args, batch, MODES)
    for mode in MODES:
        for _ in range(2):
            step.stage()
            step.forward(mode)
        step.stage()  # one selection for the profiled steps: the staging's kernels stay out
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step.forward(mode)
            torch.cuda.synchronize()
        per = args.steps * args.layers
        kernels, launches = collections.Counter(), 0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.name[:80]] += e.device_time / per
                launches += 1
        ops = collections.Counter()  # the same time by the torch op that launched it
        for e in prof.key_averages():
            if e.key.startswith("aten::") and e.self_device_time_total > 0:
                ops[e.key[:80]] += e.self_device_time_total / per
        print(
            f"\n{mode} batch {batch}: {sum(kernels.values()):.1f} us of kernels per layer, "
            f"{launches / per:.0f} launches per layer (LM head spread over the layers)"
        )
        for what, table in (("kernel", kernels), ("aten op", ops)):
            print(f"-- by {what}")
            for name, t in table.most_common(top):
                print(f"{t:9.1f} us  {name}")


# --kernel-split: which of the core's calls each kernel of an eager step ran under
SPLIT = ("indexer", "top-k", "resolve", "row read / misses", "attention", "save (copy stream)")


def _split_hooks(step: CoreStep) -> list:
    """(owner, attribute, category) of the calls whose kernels make each category; a call
    inside another (the indexer's scores inside the selection) takes its own."""
    from hisparse import ops
    from hisparse.models.dsa.kernels import misses, rows

    hooks = [
        (step.core, "_scores_fn", "indexer"),  # the Triton kernel or DeepGEMM's
        (step.core, "store_keys", "indexer"),
        (step.core, "select", "top-k"),  # what select runs beside the scores: topk, the slots
        (rows, "gather_decode", "row read / misses"),
        (misses, "read_with_misses", "row read / misses"),
        (misses, "stage_misses", "row read / misses"),
        (step.core, "query", "attention"),  # the absorbed query (made beside the misses' copy)
        (step.core, "attend_query", "attention"),  # scores, softmax, the values' product
        (step.core, "attend", "attention"),  # both, where a caller makes them in one call
        (ops, "save_rows", "save (copy stream)"),
        (step, "stage", "staging"),  # the next step's selection: not part of a step
    ]
    for lay in step.layers:
        if lay.rt is not None:
            hooks += [(lay.rt, "resolve", "resolve"), (lay.rt, "gather", "row read / misses")]
    return hooks


class _Annotated:
    """The hooks' calls wrapped in ``record_function("split::<category>")`` while inside."""

    def __init__(self, hooks: list) -> None:
        self.hooks = hooks

    def __enter__(self):
        from torch.profiler import record_function

        self.saved = []
        for owner, name, cat in self.hooks:
            fn = getattr(owner, name)
            self.saved.append((owner, name, owner.__dict__.get(name, _MISSING)))

            def wrapped(*a, _fn=fn, _cat=cat, **k):
                with record_function(f"split::{_cat}"):
                    return _fn(*a, **k)

            setattr(owner, name, wrapped)
        return self

    def __exit__(self, *exc):
        for owner, name, old in reversed(self.saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


_MISSING = object()
# By name, for a kernel the profiler linked to no call: Triton's launches and the external
# extensions' (no aten op around them; on the H200 the profiler tied none of them to the
# enclosing record_function)
_BY_NAME = (
    ("_paged_scores", "indexer"), ("paged_mqa_logits", "indexer"), ("_store_fp8_keys", "indexer"),
    ("resolve", "resolve"),
    ("_selection_slots", "top-k"), ("gather_decode", "row read / misses"),
    ("_read_with_misses", "row read / misses"), ("_stage", "row read / misses"),
    ("masked_softmax", "attention"), ("_sparse_mla", "attention"), ("_combine", "attention"),
    ("flash_fwd", "attention"),  # FlashMLA's sparse decode and its combine
)  # fmt: skip


def _category(event) -> str | None:
    while event is not None:
        if event.name.startswith("split::"):
            return event.name[len("split::") :]
        event = event.cpu_parent
    return None


def split_step(step: CoreStep, mode: str, steps: int) -> dict:
    """Kernel time per layer of ``steps`` eager steps of ``mode`` by category (``SPLIT``, and
    "rest": projections, norms, MLP, the LM head spread over the layers), each step after its
    own staged selection (whose kernels are left out), and by kernel."""
    from torch.profiler import ProfilerActivity, profile

    cuda = step.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with _Annotated(_split_hooks(step)):
        for _ in range(2):
            step.stage()
            step.forward(mode)
        sync()
        with profile(activities=acts) as prof:
            for _ in range(steps):
                step.stage()
                step.forward(mode)
            sync()
    per = steps * step.cfg.layers
    cats, kernels = collections.Counter(), collections.Counter()
    linked = collections.Counter()  # kernel name -> us the CPU events account for
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.kernels:
            continue
        cat = _category(e) or "rest"
        for k in e.kernels:
            cats[cat] += k.duration / per
            kernels[(cat, k.name[:70])] += k.duration / per
            linked[k.name] += k.duration
    unlinked = collections.Counter()
    for e in prof.events():
        # the GPU-side spans of the split:: annotations are not kernels
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("split::"):
            unlinked[e.name] += e.device_time
    for name, total in unlinked.items():  # kernels no CPU event claimed
        extra = total - linked.get(name, 0.0)
        if extra > 0.01 * total and extra > 0:
            cat = next((c for pat, c in _BY_NAME if pat in name), "rest")
            cats[cat] += extra / per
            kernels[(cat + " (by name)", name[:70])] += extra / per
    cats.pop("staging", None)
    out = {c: round(cats.get(c, 0.0), 2) for c in (*SPLIT, "rest")}
    out["total"] = round(sum(out.values()), 2)
    top = [(c, n, round(t, 2)) for (c, n), t in kernels.most_common() if c != "staging"]
    return {"per_layer_us": out, "kernels": top[:40]}


def kernel_split(args, batches: list) -> dict:
    """Per mode and batch: the captured step's ms (``measure``), its kernels per layer by
    category (eager steps, ``split_step``), and each category's slope per request and layer
    between the smallest and the largest batch."""
    got = {}
    for b in batches:
        step = _step(args, b, MODES)
        row = measure(step, args.rounds, args.steps)
        row["per_layer"] = {m: split_step(step, m, args.split_steps) for m in MODES}
        for m in MODES:
            row["per_layer"][m]["graph_us"] = round(row[f"{m}_ms_per_step"] * 1e3 / args.layers, 2)
        row["attention"] = step.core.attention
        row["indexer"] = step.core.indexer
        row["misses_read"] = "in_read" if step.core.reads_misses(b) else "gather"
        got[b] = row
        print(json.dumps(row), flush=True)
        del step
        torch.cuda.empty_cache()
    lo, hi = min(batches), max(batches)
    slope = {}
    if hi > lo:
        for m in MODES:
            a, z = got[lo]["per_layer"][m], got[hi]["per_layer"][m]
            s = {c: round((z["per_layer_us"][c] - a["per_layer_us"][c]) / (hi - lo), 3)
                 for c in (*SPLIT, "rest", "total")}  # fmt: skip
            s["graph"] = round((z["graph_us"] - a["graph_us"]) / (hi - lo), 3)
            slope[m] = s
    return {"batches": [got[b] for b in batches], "per_request_layer_us": slope,
            "between": [lo, hi]}  # fmt: skip


def per_request_layer_us(rows: list, layers: int) -> dict:
    """Each mode's step cost per request and layer: the slope of ms/step against the batch
    between the smallest and the largest batch timed (what bounds the tokens/s at capacity)."""
    if len(rows) < 2:
        return {}
    lo, hi = min(rows, key=lambda r: r["batch"]), max(rows, key=lambda r: r["batch"])
    out = {}
    for m in MODES:
        key = f"{m}_ms_per_step"
        if key in lo and key in hi:
            slope = (hi[key] - lo[key]) / (hi["batch"] - lo["batch"]) / layers
            out[m] = round(slope * 1e3, 3)
    return {"batches": [lo["batch"], hi["batch"]], **out}


def capacity(args, rows: list, limit: dict) -> dict:
    """Each mode at its budget's limit: the batch table's row where it has one, else a run."""
    tok = {}
    hit = None
    for m in MODES:
        got = next((r for r in rows if r["batch"] == limit[m]), None)
        if got is None:
            got = run(args, limit[m], (m,), limit["resident"])
            print(json.dumps(got), flush=True)
        tok[m] = got[f"{m}_tok_s"]
        hit = got.get("hit_rate", hit) if m == "hisparse" else hit
    return {
        "budget_gib": MemoryBudget().kv_gib,
        "context": args.context,
        "max_batch": limit,
        "tok_s": tok,
        "ratio": round(tok["hisparse"] / tok["resident"], 3),
        "hit_rate": hit,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=32768, help="tokens per request")
    p.add_argument("--batches", default="1,16,30,64,112")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hot-size", type=int, default=4096)
    p.add_argument("--miss", type=float, default=0.05, help="new share of the top-k per step")
    p.add_argument(
        "--attention", choices=ATTENTION, default="auto",
        help="the core's sparse MLA; auto: FlashMLA where importable and faster, else bmm",
    )  # fmt: skip
    p.add_argument(
        "--indexer", choices=INDEXER, default="auto",
        help="the indexer's scores; auto: DeepGEMM's where importable and faster, else Triton",
    )  # fmt: skip
    p.add_argument(
        "--misses", choices=MISSES, default="auto",
        help="HiSparse's misses: gathered before the row read, or fetched by it (in_read)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--capacity", action="store_true", help="each mode at its budget's limit")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--profile", type=int, default=0, help="print the top N kernels and ops")
    p.add_argument(
        "--kernel-split", action="store_true",
        help="per batch and mode: the captured step, its kernels per layer by category "
        "(indexer, top-k, resolve, row read / misses, attention, rest) and their slopes",
    )  # fmt: skip
    p.add_argument("--split-steps", type=int, default=3, help="eager steps profiled per mode")
    p.add_argument(
        "--commit", default="?", help="the tree's commit for the JSON (a device copy's is stale)"
    )
    args = p.parse_args(argv)
    try:
        batches = [int(x) for x in args.batches.split(",") if x]
        _config(args).check()
        if args.kernel_split and (not batches or args.split_steps < 1):
            raise ValueError("--kernel-split needs --batches and --split-steps >= 1")
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():
        print("bench_decode_tpot needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.profile:
        for b in batches:
            profile(args, b, args.profile)
        return 0
    if args.kernel_split:
        result = {
            "core": CORE, "device": torch.cuda.get_device_name(), "commit": args.commit,
            "config": {"context": args.context, "layers": args.layers, "hot_size": args.hot_size,
                       "miss": args.miss, "attention": args.attention, "misses": args.misses},
            "rounds": args.rounds, "steps": args.steps, "split_steps": args.split_steps,
            "kernel_split": kernel_split(args, batches),
        }  # fmt: skip
        print(json.dumps(result["kernel_split"]["per_request_layer_us"]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    budget = MemoryBudget()
    limit = {m: budget.max_batch(_config(args), m == "resident") for m in MODES}
    rows = []
    for b in batches:
        t0 = time.time()
        rows.append(run(args, b, MODES, limit["resident"]))
        print(json.dumps(rows[-1]), f"({time.time() - t0:.0f} s)", flush=True)
    result = {
        "core": CORE,
        "device": torch.cuda.get_device_name(),
        "commit": args.commit,
        "config": {
            "context": args.context,
            "layers": args.layers,
            "hot_size": args.hot_size,
            "top_k": 2048,
            "miss": args.miss,
            "attention": args.attention,
            "misses": args.misses,
            "mlp": "dense SwiGLU 18432 (the MoE's active width)",
            "vocab": GraphConfig().vocab,
        },
        "rounds": args.rounds,
        "steps": args.steps,
        "batches": rows,
        "per_request_layer_us": per_request_layer_us(rows, args.layers),
    }
    if args.capacity:
        result["capacity"] = capacity(args, rows, limit)
        print(json.dumps(result["capacity"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
