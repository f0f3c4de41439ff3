"""Fused Triton kernels for the two per-request parts of the decode step that torch runs as many
memory passes: reading the selected FP8 rows into attention's bf16 values, and the DSA indexer's
scores over the whole context. Both modes call the same kernels, so parity between them holds
whichever path runs; ``gather_decode`` is also bit-identical to
``decode_rows(src[ids], "fp8", bfloat16)``.

Why: at batch 112 the torch path spends about 40 % of the step's kernel time in
``decode_rows``' seven elementwise passes (contiguous copies, the fp8 and scale conversions, a
broadcast multiply, a concatenation) and another 20 % writing, rectifying and re-reading the
indexer's [batch, heads, context] logits (benchmarks/results/step_kernels_h200.md). That is cost
per request, which is what bounds throughput at HiSparse's capacity. The indexer kernel reads the
keys in FP8 with a scale per token, as DeepSeek-V3.2 stores them.

``gather_decode`` can also read a HiSparse part's rows in two halves around a copy of its misses
(``part=``; the copy and the other ways to bring misses in are in ``miss_kernels``).

``available()`` says whether they can run (CUDA tensors, Triton importable); the step falls back
to the torch path otherwise (the CPU tests run that one).
"""

from __future__ import annotations

import torch

from hisparse.models.rows import FP8_TILE, KV_DIM, LATENT_DIM, ROPE_DIM, ROW_LAYOUTS

ROW_BYTES = ROW_LAYOUTS["fp8"].row_bytes
SCALE_AT = LATENT_DIM // 4  # first scale, in float32 words of a row
ROPE_AT = (LATENT_DIM + 4 * (LATENT_DIM // FP8_TILE)) // 2  # first rope value, in bf16 words

try:  # Triton ships with CUDA builds of torch; without it the torch path runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available(device: torch.device) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


def use_triton(fused, device) -> bool:
    """Whether a step on ``device`` runs these kernels: ``fused`` None means wherever they can;
    True where they cannot is refused by name."""
    can = available(device)
    if fused and not can:
        raise ValueError(f"fused=True needs Triton and a CUDA device; the KV is on {device}")
    return can if fused is None else bool(fused)


if triton is not None:

    @triton.jit
    def _gather_decode(
        src_u8, src_f32, src_bf16, ids, out, n, pending,
        ROW_U8: tl.constexpr, ROW_F32: tl.constexpr, ROW_BF16: tl.constexpr,
        SCALE0: tl.constexpr, ROPE0: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr,
        TILE: tl.constexpr, OUT_W: tl.constexpr, BLOCK: tl.constexpr, PART: tl.constexpr,
    ):  # fmt: skip
        # PART 0: every row; 1: rows with no pending miss; 2: the rows with one.
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = r < n
        row = tl.load(ids + r, mask=ok, other=0).to(tl.int64)
        if PART != 0:
            k = tl.load(pending + row, mask=ok, other=-1)
            if PART == 1:
                ok = ok & (k < 0)
            else:
                ok = ok & (k >= 0)
        dst = out + r.to(tl.int64)[:, None] * OUT_W
        c = tl.arange(0, LAT)
        q = tl.load(src_u8 + row[:, None] * ROW_U8 + c[None, :], mask=ok[:, None], other=0)
        s = tl.load(src_f32 + row[:, None] * ROW_F32 + SCALE0 + (c // TILE)[None, :],
                    mask=ok[:, None], other=0.0)  # fmt: skip
        # As torch computes fp8.to(bf16) * scale.to(bf16): exact fp8 -> float, the scale rounded
        # to bf16, one float product rounded to bf16.
        q = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s = s.to(tl.bfloat16).to(tl.float32)
        tl.store(dst + c[None, :], (q * s).to(tl.bfloat16), mask=ok[:, None])
        e = tl.arange(0, ROPE)
        rope = tl.load(src_bf16 + row[:, None] * ROW_BF16 + ROPE0 + e[None, :],
                       mask=ok[:, None], other=0.0)  # fmt: skip
        tl.store(dst + LAT + e[None, :], rope, mask=ok[:, None])

    @triton.jit
    def _indexer(
        q, hw, keys, scales, out, ctx,
        H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, TILES: tl.constexpr,
    ):  # fmt: skip
        # TILES tiles of keys per program, the query and head weights loaded once for them.
        b = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, H)
        d = tl.arange(0, D)
        qb = tl.load(q + b * H * D + h[:, None] * D + d[None, :])
        w = tl.load(hw + b * H + h).to(tl.float32)
        for i in tl.range(0, TILES):
            t = (tl.program_id(1) * TILES + i) * BLOCK_T + tl.arange(0, BLOCK_T)
            ok = t < ctx
            k = tl.load(keys + (b * ctx + t[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0)
            logits = tl.maximum(tl.dot(k.to(tl.bfloat16), tl.trans(qb)), 0.0)  # [BLOCK_T, H]
            s = tl.load(scales + b * ctx + t, mask=ok, other=0.0)
            # relu(s x) = s relu(x) for the positive per-token scale: applied once, after the sum.
            tl.store(out + b * ctx + t, tl.sum(logits * w[None, :], axis=1) * s, mask=ok)


PARTS = {"all": 0, "hits": 1, "misses": 2}


def check_rows(*, pinned: tuple = (), **buffers: torch.Tensor) -> None:
    """Each named buffer is a contiguous uint8 [rows, 656] row buffer; those named in ``pinned``
    are page-locked host memory (which the device reads over PCIe)."""
    for what, t in buffers.items():
        if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != ROW_BYTES:
            raise ValueError(f"{what} must be uint8 [rows, {ROW_BYTES}], got {t.dtype} {t.shape}")
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        if what in pinned and not t.is_pinned():
            raise ValueError(f"{what} must be pinned (page-locked) memory")


def gather_decode(
    src: torch.Tensor,
    ids: torch.Tensor,
    *,
    pending: torch.Tensor | None = None,
    part: str = "all",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows ``ids`` (any shape, int32/int64) of ``src`` (uint8 [N, 656], FP8 layout) decoded to
    bf16 [*ids.shape, 576]: ``decode_rows(src[ids], "fp8", torch.bfloat16)`` in one pass.

    ``part`` splits the read around a copy in flight: "hits" decodes only the rows with no
    pending miss (``pending[row] < 0``), "misses" only the others (after their copy landed); both
    write into ``out``, so the two give exactly the "all" result."""
    check_rows(src=src)
    if part not in PARTS:
        raise ValueError(f"part must be one of {tuple(PARTS)}, got {part!r}")
    if (part == "all") != (pending is None):
        raise ValueError("pending is needed for part='hits' or 'misses', and only then")
    flat = ids.reshape(-1).contiguous()
    shape = (*ids.shape, KV_DIM)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=src.device)
    elif out.shape != shape or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(
            f"out must be contiguous bfloat16 {list(shape)}, got {out.dtype} {out.shape}"
        )
    n, block = flat.numel(), 16
    _gather_decode[(triton.cdiv(n, block),)](
        src, src.view(torch.float32), src.view(torch.bfloat16), flat, out, n,
        flat if pending is None else pending,
        ROW_BYTES, ROW_BYTES // 4, ROW_BYTES // 2, SCALE_AT, ROPE_AT, LATENT_DIM, ROPE_DIM,
        FP8_TILE, KV_DIM, block, PARTS[part], num_warps=4,
    )  # fmt: skip
    return out


def indexer_fits(heads: int, dim: int) -> bool:
    """The fused indexer's tile shapes: powers of two of at least 16 (tensor-core dot)."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (heads, dim))


def indexer_scores(
    q: torch.Tensor,
    hw: torch.Tensor,
    keys: torch.Tensor,
    scales: torch.Tensor,
    *,
    block_t: int = 64,
    tiles: int = 4,
    warps: int = 4,
) -> torch.Tensor:
    """sum_h hw[b, h] * relu(q[b, h] . keys[b, t] * scales[b, t]) in float32: q [n, H, D] bf16,
    hw [n, H], keys [n, ctx, D] float8_e4m3fn, scales [n, ctx] float32 (positive) -> [n, ctx]
    float32, the keys read once (no [n, H, ctx] logits). A program scores ``tiles`` tiles of
    ``block_t`` keys with ``warps`` warps; 64 x 4 x 4 was the fastest of eight shapes on an H200,
    8-11 % under one tile of 128 (benchmarks/results/indexer_h200.json)."""
    n, H, D = q.shape
    ctx = keys.shape[1]
    if not indexer_fits(H, D):
        raise ValueError(f"the fused indexer needs powers of two >= 16, got {H} heads x {D}")
    if keys.dtype != torch.float8_e4m3fn or scales.shape != keys.shape[:2]:
        raise ValueError("keys must be float8_e4m3fn [n, ctx, D] with float32 scales [n, ctx]")
    q, hw, keys = q.contiguous(), hw.contiguous(), keys.contiguous()
    scales = scales.to(torch.float32).contiguous()
    out = torch.empty(n, ctx, dtype=torch.float32, device=q.device)
    grid = (n, triton.cdiv(ctx, block_t * tiles))
    _indexer[grid](q, hw, keys, scales, out, ctx, H, D, block_t, tiles, num_warps=warps)
    return out
