"""FlashMLA's sparse FP8 decode (DeepSeek's kernel; a CUDA vLLM ships it) as the core's attention
over FP8 rows, where a build of it is importable, and the measurement that picks it.

Why: on an H200 it was 1.2-2.6x faster than the project's kernels over the same rows, both timed
as graph replays (benchmarks/results/kernels_vs_baselines_h200.md). Its "FP8 with scale" cache
layout is the project's fp8 row byte for byte (512 fp8 values, 4 float32 scales, 64 bf16 rope
values), so it reads the resident store and the hot buffers as they are, with the same ids (-1:
padding).

Sources, tried in order: modules registered by ``add_source`` (the vLLM integration registers
vLLM's own FlashMLA ops), then the standalone ``flash_mla`` package. Each must offer FlashMLA's
``flash_mla_with_kvcache`` and ``get_mla_metadata``; a module with
``is_flashmla_sparse_supported`` is used only where that says yes.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from hisparse.models.dsa.kernels.probe import first_module, replay_us
from hisparse.models.rows import LATENT_DIM

log = logging.getLogger("hisparse")
_SOURCES: list = ["flash_mla"]
_CHOICE: dict = {}  # (device, heads, top_k) -> "flashmla" | "bmm"
PROBE_BATCHES = (1, 64)
HEAD_BLOCK = 64  # FlashMLA's sparse decode takes query heads in blocks of 64
MAX_HEADS = 128  # and at most two such blocks (64 or 128 query heads)
TOPK_BLOCK = 64  # and ids in blocks of 64: any other count aborts the process (a C++ assert)


def supports(heads: int) -> bool:
    """Whether FlashMLA's SM90 sparse decode takes ``heads`` query heads (padded to a block)."""
    return 0 < heads <= MAX_HEADS


def require(found: Optional["FlashMLADecode"], heads: int) -> None:
    """Refuse ``attention='flashmla'`` in one line where it cannot serve."""
    if found is None:
        raise ValueError("attention='flashmla' needs FlashMLA importable (vLLM's or flash_mla)")
    if not supports(heads):
        raise ValueError(
            f"attention='flashmla' takes at most {MAX_HEADS} query heads, the model has {heads}: "
            "pass attention='bmm' or 'auto'"
        )


def add_source(module: str) -> None:
    """Try ``module`` first (an import path offering FlashMLA's interface)."""
    if module not in _SOURCES:
        _SOURCES.insert(0, module)


class FlashMLADecode:
    """``flash_mla_with_kvcache`` over FP8 rows by id, one scheduling plan per shape (FlashMLA
    plans a shape at its first call and reuses the plan for that shape)."""

    def __init__(self, module) -> None:
        self.module = module
        self.name = module.__name__
        self._plans: dict = {}

    def __call__(self, q: torch.Tensor, src: torch.Tensor, ids: torch.Tensor, scale: float):
        """q [n, heads, 576] bf16 over rows ``ids`` [n, K] of ``src`` (uint8 [N, 656]) ->
        latent mix [n, heads, 512] bf16."""
        n, heads, _ = q.shape
        if heads % HEAD_BLOCK:  # a rank's share of the heads under TP: pad, then drop the pad
            q = torch.nn.functional.pad(q, (0, 0, 0, -heads % HEAD_BLOCK))
            return self(q, src, ids, scale)[:, :heads]
        if ids.shape[1] % TOPK_BLOCK:  # padding ids (-1) read nothing and weigh nothing
            ids = torch.nn.functional.pad(ids, (0, -ids.shape[1] % TOPK_BLOCK), value=-1)
        block = _page_block(src.shape[0])
        key = (n, heads, ids.shape[1], block, q.device)
        plan = self._plans.get(key)
        if plan is None:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"FlashMLA plans each shape at its first call: run one eager step of batch {n} "
                    "before capturing it (or pass attention='bmm')"
                )
            plan = self._plans[key] = self.module.get_mla_metadata()[0]
        out = self.module.flash_mla_with_kvcache(
            q.view(n, 1, heads, q.shape[-1]),
            src.view(-1, block, 1, src.shape[1]),
            None,
            None,
            LATENT_DIM,
            plan,
            softmax_scale=scale,
            is_fp8_kvcache=True,
            indices=ids.to(torch.int32).view(n, 1, -1),
        )[0]
        return out.view(n, heads, LATENT_DIM)


def _page_block(rows: int) -> int:
    """The largest page block of at most 64 rows (vLLM's for these rows) dividing ``rows``: ids
    are row numbers either way, the view only has to cover every row."""
    b = 64
    while rows % b:
        b //= 2
    return b


def find() -> Optional[FlashMLADecode]:
    """The first importable, supported source, or None."""
    module = first_module(_SOURCES, _offers_sparse_decode)
    return None if module is None else FlashMLADecode(module)


def _offers_sparse_decode(module) -> bool:
    ok = getattr(module, "is_flashmla_sparse_supported", None)
    if ok is not None and not ok()[0]:
        return False
    return hasattr(module, "flash_mla_with_kvcache") and hasattr(module, "get_mla_metadata")


def choose(device, heads: int, top_k: int, bmm) -> str:
    """ "flashmla" where a source exists and its times summed over the probe batches are below
    ``bmm``'s (the project's attention, called as ``bmm(q, src, ids, scale)``), else "bmm";
    measured once per device and shape, said in one log line."""
    key = (torch.device(device), heads, top_k)
    if key in _CHOICE:
        return _CHOICE[key]
    flash = find()
    if flash is None or not supports(heads):
        why = "no FlashMLA importable" if flash is None else f"FlashMLA lacks {heads} heads"
        log.info("hisparse: sparse MLA by the Triton kernels (%s)", why)
        _CHOICE[key] = "bmm"
        return "bmm"
    try:
        times = {b: _probe(flash, bmm, device, heads, top_k, b) for b in PROBE_BATCHES}
    except Exception as e:  # noqa: BLE001 - a build that fails here must not serve
        log.warning("hisparse: sparse MLA by the Triton kernels (FlashMLA from %s failed its "
                    "probe: %s: %s)", flash.name, type(e).__name__, e)  # fmt: skip
        _CHOICE[key] = "bmm"
        return "bmm"
    # A summed step, as the indexer's choice: with a warm L2 the batched products can win at one
    # request by a few microseconds that FlashMLA gives back many times over at 64.
    fl, bm = sum(f for f, _ in times.values()), sum(t for _, t in times.values())
    won = fl < bm
    _CHOICE[key] = "flashmla" if won else "bmm"
    said = ", ".join(f"{f:.0f} vs {t:.0f} us at batch {b}" for b, (f, t) in times.items())
    log.info(
        "hisparse: sparse MLA by %s (FlashMLA from %s against the Triton kernels: %s; the lower "
        "sum over these batches wins: %.0f vs %.0f us)",
        "FlashMLA" if won else "the Triton kernels", flash.name, said, fl, bm,
    )  # fmt: skip
    return _CHOICE[key]


def _probe(flash, bmm, device, heads, top_k, batch) -> tuple:
    """Replayed microseconds of (FlashMLA, bmm) on random rows, ``top_k`` of 4 x ``top_k`` each."""
    from hisparse.models.rows import encode_rows

    g = torch.Generator(device=device).manual_seed(0)
    n_rows = batch * 4 * top_k
    src = encode_rows(torch.randn(n_rows, 576, device=device, generator=g), "fp8")
    ids = torch.randperm(n_rows, device=device, generator=g)[: batch * top_k].view(batch, -1)
    q = torch.randn(batch, heads, 576, device=device, generator=g).bfloat16()
    return tuple(replay_us(lambda fn=fn: fn(q, src, ids, 0.1)) for fn in (flash, bmm))
