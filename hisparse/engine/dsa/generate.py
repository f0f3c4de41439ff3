"""Greedy generation for a DSA checkpoint directory in any mode (resident, hisparse, hybrid),
and the resident-vs-HiSparse (and, with a device budget, hybrid) parity run behind ``hisparse
demo --model DIR``.

Requests run batched, as a server runs them: each step decodes every running request and
admits (prefills) at most one waiting one while fewer than ``max_batch`` run, so requests of
different lengths join and leave the batch; each runs in its own block / connector state row.
``prefill_first``: a step that admits decodes nothing, so every request is admitted before the
batch decodes (a benchmark's fixed batch). A run records its decode-only time (``clock``), each
step's size, and the KV bytes it holds on the device (``budget``).
Prompts are byte tokens (ids below the vocabulary), at least four times ``index_topk`` long so
the top-k selection matters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import accumulate
from typing import List, Optional, Sequence, Tuple

import torch

from hisparse.engine.dsa.budget import context_rows, held
from hisparse.engine.dsa.clock import DecodeClock
from hisparse.engine.dsa.graphs import DecodeGraphs
from hisparse.engine.dsa.hybrid import HybridRows
from hisparse.engine.dsa.model import DSAForward
from hisparse.engine.dsa.residency import check_device_blocks
from hisparse.engine.dsa.stores import HiSparseRows, ResidentRows, upload
from hisparse.models.dsa.weights import (
    Checkpoint,
    CheckpointError,
    checkpoint_config,
    load_checkpoint,
)
from hisparse.models.rows import FORMATS, FP8_TILE, fits
from hisparse.ops.limits import default_hot_size

MODES = ("resident", "hisparse")  # the parity run's two
HYBRID = "hybrid"  # device pages while a budget allows, spilled whole beyond (hybrid.py)
TEXTS = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the warm window. ",
    "Sparse attention reads a few rows of a long context; the rest stay in host memory. ",
    "In the beginning the river was quiet, and the village slept beside its slow water. ",
    "Numbers: 3.14159 2.71828 1.41421 1.73205 0.57721 4.66920 2.50290 1.61803 0.69314. ",
)


@dataclass
class Generation:
    mode: str
    tokens: List[List[int]] = field(default_factory=list)
    gaps: List[List[float]] = field(default_factory=list)  # top-1 minus top-2 logit per step
    first_logits: List[torch.Tensor] = field(default_factory=list)  # CPU float32 [vocab]
    seconds: float = 0.0
    counters: dict = field(default_factory=dict)  # the connector's totals (hisparse mode)
    graph_replays: int = 0  # decode steps replayed from a CUDA graph
    spills: int = 0  # hybrid: running requests spilled to the host pool (counters: the rest)
    decode_seconds: float = 0.0  # the timed decode-only steps (clock.DecodeClock)
    decode_steps: int = 0
    decode_tokens: int = 0
    steps: List[Tuple[int, int]] = field(default_factory=list)  # (decodes, prefill tokens)
    device_bytes: dict = field(default_factory=dict)  # budget.held: rows, index_keys


def check_options(row_format: str, mode: str = "resident", cfg=None) -> None:
    """One-line errors for the options, before any weights are read (``cfg``: the
    checkpoint's ``DSAConfig``, whose latent the row format must hold)."""
    if row_format not in FORMATS:
        raise CheckpointError(f"--row-format must be one of {list(FORMATS)}, got {row_format!r}")
    if cfg is not None and not fits(row_format, cfg.kv_lora_rank):
        raise CheckpointError(
            f"--row-format {row_format} needs kv_lora_rank to be a multiple of {FP8_TILE}; "
            f"this checkpoint's is {cfg.kv_lora_rank}: use bf16 or f32"
        )
    if mode not in MODES + (HYBRID,):
        raise CheckpointError(f"mode must be one of {MODES + (HYBRID,)}, got {mode!r}")


def byte_prompts(ck: Checkpoint, count: int, texts: Sequence[str] = TEXTS) -> List[List[int]]:
    """``count`` prompts of byte tokens, each at least 4 x index_topk tokens (text repeated)."""
    n = max(4 * ck.cfg.index_topk, 64)
    out = []
    for i in range(count):
        data = texts[i % len(texts)].encode() * (n // len(texts[i % len(texts)]) + 1)
        out.append([b % ck.spec.vocab_size for b in data[: n + 7 * i]])
    return out


def _context(prompts: Sequence[Sequence[int]], new: int) -> int:
    return context_rows(max(len(p) for p in prompts) + new)


def generate(
    ck: Checkpoint,
    mode: str,
    row_format: str,
    device: torch.device,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    hot_size: Optional[int] = None,
    *,
    max_batch: Optional[int] = None,
    key_format: Optional[str] = None,
    backend: str = "auto",
    step_hook=None,
    graphs: Optional[bool] = None,
    misses: str = "auto",
    device_blocks: Optional[int] = None,
    prefill_first: bool = False,
    hot_slots: Optional[int] = None,
) -> Generation:
    """Greedy tokens of every prompt (no stop token: every prompt gets ``max_new``).
    ``step_hook(fn)``: runs each forward (a test wraps it, e.g. in a sync check). ``graphs``:
    replay decode steps from CUDA graphs (``hisparse.engine.dsa.graphs``; default on CUDA).
    ``misses``: how HiSparse's misses reach the row read (``SparseMLACore``'s setting).
    ``device_blocks``: mode "hybrid"'s device budget, in blocks of ``BLOCK`` rows; ``hot_slots``
    its hot buffers (requests spilled at once; default one per request).
    ``prefill_first``: admit every request before the batch decodes (module docstring)."""
    check_options(row_format, mode, ck.cfg)
    try:
        check_device_blocks(device_blocks, mode, hot_slots)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    graphs = device.type == "cuda" if graphs is None else graphs
    nmax = max(1, min(max_batch or len(prompts), len(prompts)))
    ctx = _context(prompts, max_new)
    store, fwd = open_run(
        ck, mode, row_format, device, ctx, nmax, hot_size, key_format, backend, misses,
        device_blocks=device_blocks, hot_slots=hot_slots,
    )  # fmt: skip
    out = new_generation(Generation(mode), len(prompts))
    out.device_bytes = held(store, fwd)
    runner = DecodeGraphs(fwd, store) if graphs else None
    forward = runner.step if runner else (lambda *a: fwd.step(store, *a))
    clock = DecodeClock(device)
    t0 = time.perf_counter()
    try:
        _run(fwd, store, forward, prompts, max_new, nmax, out, step_hook, clock, prefill_first)
    finally:
        out.counters = store.close()
        out.graph_replays = runner.replays if runner else 0
        out.spills = out.counters.get("spills", 0)
    out.decode_seconds, out.decode_steps, out.decode_tokens = clock.totals()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out.seconds = time.perf_counter() - t0
    return out


def open_run(
    ck, mode, row_format, device, ctx, nmax, hot_size, key_format, backend, misses="auto", q=1,
    *, device_blocks=None, hot_slots=None,
):  # fmt: skip
    """(row store of ``mode``, forward pass) for ``nmax`` requests of ``ctx`` tokens whose
    decodes have up to ``q`` query tokens (the hot size grows to hold q x top-k)."""
    rb = ck.cfg.row_bytes(row_format)
    if mode == "resident":
        store = ResidentRows(ck.cfg, rb, ctx, device, nmax)
    elif mode == HYBRID:
        if q != 1:
            raise CheckpointError("hybrid residency decodes one token per request (q = 1)")
        hot = hot_size or default_hot_size(ck.cfg.index_topk)
        store = HybridRows(ck.cfg, rb, ctx, device, hot, nmax, device_blocks, hot_slots)
    else:
        hot = hot_size or max(default_hot_size(ck.cfg.index_topk), q * ck.cfg.index_topk)
        store = HiSparseRows(ck.cfg, rb, ctx, device, hot, nmax, decode_tokens=q)
    fwd = DSAForward(
        ck, row_format, device, max_requests=nmax, max_context=ctx, key_format=key_format,
        backend=backend, misses=misses,
    )  # fmt: skip
    return store, fwd


def new_generation(out: Generation, n: int) -> Generation:
    """``out`` with an empty record for each of ``n`` prompts."""
    out.tokens = [[] for _ in range(n)]
    out.gaps = [[] for _ in range(n)]
    out.first_logits = [None] * n
    return out


def _run(fwd: DSAForward, store, forward, prompts, max_new, nmax, out, hook, clock, first):
    waiting = list(range(len(prompts)))
    running: List[int] = []  # requests that decode next step, in admission order
    lengths = {}  # request -> tokens in its context so far
    dev = fwd.device
    while waiting or running:
        # hybrid: a request waits while neither pages nor a hot buffer are free for it
        admit = bool(waiting) and len(running) < nmax and store.admits(len(prompts[waiting[0]]))
        idle = running if admit and first else []  # prefill_first: they decode later
        rows = ([] if idle else list(running)) + ([waiting.pop(0)] if admit else [])
        nd = len(rows) - admit
        prefill = rows[nd:]
        new = {r: 1 for r in rows[:nd]}
        new.update({r: len(prompts[r]) for r in prefill})
        clock.before(nd, len(prefill))
        out.steps.append((nd, sum(len(prompts[r]) for r in prefill)))
        blocks = store.begin({f"req-{r}": new[r] for r in rows})
        toks, pos, req = [], [], []
        for b, r in enumerate(rows):
            if r in prefill:
                toks += list(prompts[r])
                pos += range(len(prompts[r]))
                lengths[r] = len(prompts[r])
            else:
                toks.append(out.tokens[r][-1])
                pos.append(lengths[r])
                lengths[r] += 1
            req += [b] * new[r]
        last = [i - 1 for i in accumulate(new[r] for r in rows)]
        batch = fwd.batch(
            upload(pos, dev),
            upload(req, dev),
            upload([lengths[r] for r in rows], dev),
            upload(blocks, dev),
        )
        args = (upload(toks, dev), batch, upload(last, dev), nd)
        logits = hook(lambda: forward(*args)) if hook else forward(*args)
        store.end()
        top = logits.topk(2, dim=-1).values
        gaps = (top[:, 0] - top[:, 1]).tolist()
        picked = logits.argmax(dim=-1).tolist()
        running = list(idle)
        for b, r in enumerate(rows):
            if not out.tokens[r]:
                out.first_logits[r] = logits[b].float().cpu()
            out.tokens[r].append(picked[b])
            out.gaps[r].append(gaps[b])
            if len(out.tokens[r]) < max_new:
                running.append(r)
            else:
                store.finish(f"req-{r}")
    clock.stop()


def parity(
    model_dir: str,
    device: torch.device,
    row_format: str,
    num_prompts: int = 3,
    max_new: int = 16,
    hot_size: Optional[int] = None,
    device_blocks: Optional[int] = None,
) -> dict:
    """Resident vs HiSparse on the checkpoint: the summary ``hisparse demo --model`` prints.
    ``device_blocks``: also hybrid residency under that budget, its tokens equal too."""
    cfg = checkpoint_config(model_dir)[0]
    check_options(row_format, cfg=cfg)
    modes = MODES + ((HYBRID,) if device_blocks is not None else ())
    try:
        check_device_blocks(device_blocks, modes[-1])
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    if hot_size is not None and hot_size < cfg.index_topk:
        raise CheckpointError(
            f"--hot-size must be >= the checkpoint's index_topk ({cfg.index_topk}), got {hot_size}"
        )
    ck = load_checkpoint(model_dir, device)
    prompts = byte_prompts(ck, num_prompts)
    runs = {
        m: generate(ck, m, row_format, device, prompts, max_new, hot_size,
                    device_blocks=device_blocks if m == HYBRID else None)
        for m in modes
    }  # fmt: skip
    res, his = runs["resident"], runs["hisparse"]
    equal = sum(all(g.tokens[i] == t for g in runs.values()) for i, t in enumerate(res.tokens))
    out = {
        "model": str(model_dir),
        "arch": ck.cfg.arch,
        "indexer_types": list(ck.cfg.indexer_types),
        "device": str(device),
        "row_format": row_format,
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "new_tokens": max_new,
        "index_topk": ck.cfg.index_topk,
        "hot_size": hot_size or default_hot_size(ck.cfg.index_topk),
        "tokens_equal": equal,
        "parity": equal == len(prompts),
        "seconds": {m: round(g.seconds, 3) for m, g in runs.items()},
        "hisparse_counters": his.counters,
        "sample": bytes(t for t in res.tokens[0] if t < 256).decode("latin-1"),
        "tokens": {m: g.tokens for m, g in runs.items()},
    }
    if HYBRID in runs:
        out.update(device_blocks=device_blocks, hybrid_counters=runs[HYBRID].counters)
    return out
