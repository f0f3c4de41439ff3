"""Reading selected FP8 latent rows (656 B: 512 fp8 values in 4 scaled tiles, 64 bf16 rope
values) into attention's bf16 values in one Triton pass.

Why: torch's ``decode_rows`` is seven elementwise passes (contiguous copies, the fp8 and scale
conversions, a broadcast multiply, a concatenation); on an H200 at batch 112 that was about 40 %
of a decode step's kernel time. ``gather_decode`` is bit-identical to
``decode_rows(src[ids], "fp8", bfloat16)``, and can read a HiSparse part's rows in two halves
around a copy of its misses (``part=``).

``available()`` says whether the kernels can run (a CUDA device and Triton importable).
"""

from __future__ import annotations

import torch

from hisparse.models.rows import FP8_TILE, KV_DIM, LATENT_DIM, ROPE_DIM, ROW_FORMATS

ROW_BYTES = ROW_FORMATS["fp8"].row_bytes
SCALE_AT = LATENT_DIM // 4  # first scale, in float32 words of a row
ROPE_AT = (LATENT_DIM + 4 * (LATENT_DIM // FP8_TILE)) // 2  # first rope value, in bf16 words

try:  # Triton ships with CUDA builds of torch; without it the torch path runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available(device) -> bool:
    return triton is not None and torch.device(device).type == "cuda"


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
