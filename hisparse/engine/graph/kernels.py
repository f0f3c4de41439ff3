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

``read_rows_from_host`` is the same row read for a HiSparse part whose misses have not been
copied: a row the resolve op planned as a miss (``pending[row]`` = its host key) is read from the
pinned host pool over PCIe inside the kernel and written to its hot row for later steps, beside
the hits read from HBM; the copy then needs no SMs of its own apart from the read.
``stage_misses`` writes the resolve op's plan into ``pending`` in one launch and the read retires
each entry it uses: two launches per layer between the resolve and attention.

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
        src_u8, src_f32, src_bf16, ids, out, n,
        ROW_U8: tl.constexpr, ROW_F32: tl.constexpr, ROW_BF16: tl.constexpr,
        SCALE0: tl.constexpr, ROPE0: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr,
        TILE: tl.constexpr, OUT_W: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = r < n
        row = tl.load(ids + r, mask=ok, other=0).to(tl.int64)
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

    @triton.jit
    def _read_host_misses(
        hot_u8, hot_f32, hot_bf16, host_u8, host_f32, host_bf16, pending, ids, out, n,
        ROW_U8: tl.constexpr, ROW_F32: tl.constexpr, ROW_BF16: tl.constexpr,
        SCALE0: tl.constexpr, ROPE0: tl.constexpr, ROPE: tl.constexpr, TILES: tl.constexpr,
        TILE: tl.constexpr, OUT_W: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = r < n
        h = tl.load(ids + r, mask=ok, other=0).to(tl.int64)
        k = tl.load(pending + h, mask=ok, other=-1).to(tl.int64)
        miss = ok & (k >= 0)
        hit = ok & (k < 0)
        k = tl.where(miss, k, 0)
        # Each hot row is named once per step (distinct positions per request, disjoint hot
        # regions), so the lane that reads a planned miss also retires its entry.
        tl.store(pending + h, -1, mask=miss)
        dst = out + r.to(tl.int64)[:, None, None] * OUT_W
        t = tl.arange(0, TILES)
        j = tl.arange(0, TILE)
        lat = t[None, :, None] * TILE + j[None, None, :]
        m3, h3 = miss[:, None, None], hit[:, None, None]
        hot_q = hot_u8 + h[:, None, None] * ROW_U8 + lat
        q = tl.where(m3, tl.load(host_u8 + k[:, None, None] * ROW_U8 + lat, mask=m3, other=0),
                     tl.load(hot_q, mask=h3, other=0))  # fmt: skip
        m2, h2 = miss[:, None], hit[:, None]
        hot_s = hot_f32 + h[:, None] * ROW_F32 + SCALE0 + t[None, :]
        s = tl.where(m2, tl.load(host_f32 + k[:, None] * ROW_F32 + SCALE0 + t[None, :], mask=m2),
                     tl.load(hot_s, mask=h2))  # fmt: skip
        e = tl.arange(0, ROPE)
        hot_e = hot_bf16 + h[:, None] * ROW_BF16 + ROPE0 + e[None, :]
        rope = tl.where(m2, tl.load(host_bf16 + k[:, None] * ROW_BF16 + ROPE0 + e[None, :],
                                    mask=m2), tl.load(hot_e, mask=h2))  # fmt: skip
        # The missed rows' bytes into their hot rows: later steps hit them there.
        tl.store(hot_q, q, mask=m3)
        tl.store(hot_s, s, mask=m2)
        tl.store(hot_e, rope, mask=m2)
        qf = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sf = s.to(tl.bfloat16).to(tl.float32)[:, :, None]
        ok3 = ok[:, None, None]
        tl.store(dst + lat, (qf * sf).to(tl.bfloat16), mask=ok3)
        tl.store(out + r.to(tl.int64)[:, None] * OUT_W + TILES * TILE + e[None, :], rope,
                 mask=ok[:, None])  # fmt: skip

    @triton.jit
    def _stage_misses(pending, miss_src, miss_dst, miss_count, K, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        used = j < tl.load(miss_count + b)
        at = b.to(tl.int64) * K + j
        dst = tl.load(miss_dst + at, mask=used, other=0)
        tl.store(pending + dst, tl.load(miss_src + at, mask=used, other=0), mask=used)


class _HostRows:
    """A pinned host tensor as Triton sees a device pointer (registered host memory is mapped at
    the same address on the device), under the dtype Triton should read it as."""

    def __init__(self, t: torch.Tensor, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._ptr = t.data_ptr()

    def data_ptr(self) -> int:
        return self._ptr


def read_rows_from_host(
    hot: torch.Tensor,
    host: torch.Tensor,
    pending: torch.Tensor,
    ids: torch.Tensor,
    *,
    block: int = 64,
    warps: int = 8,
) -> torch.Tensor:
    """``gather_decode(hot, ids)``, except that a row ``h`` with ``pending[h] = key >= 0`` is
    read from ``host[key]`` (pinned, uint8 [N, 656]), its bytes written to ``hot[h]`` and
    ``pending[h]`` reset to -1 (so the next layer's plan starts from an empty table).
    ``block`` rows per program, ``warps`` per program: 64 x 8 was the fastest of five shapes at
    batches 1-112 on an H200 (benchmarks/results/in_read_h200.json)."""
    for what, t in (("hot", hot), ("host", host)):
        if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != ROW_BYTES:
            raise ValueError(f"{what} must be uint8 [rows, {ROW_BYTES}], got {t.dtype} {t.shape}")
        if not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
    if not host.is_pinned():
        raise ValueError("host must be pinned (page-locked) memory")
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(*ids.shape, KV_DIM, dtype=torch.bfloat16, device=hot.device)
    n = flat.numel()
    hv = [_HostRows(host, d) for d in (torch.uint8, torch.float32, torch.bfloat16)]
    _read_host_misses[(triton.cdiv(n, block),)](
        hot, hot.view(torch.float32), hot.view(torch.bfloat16), *hv, pending, flat, out, n,
        ROW_BYTES, ROW_BYTES // 4, ROW_BYTES // 2, SCALE_AT, ROPE_AT, ROPE_DIM,
        LATENT_DIM // FP8_TILE, FP8_TILE, KV_DIM, block, num_warps=warps,
    )  # fmt: skip
    return out


def stage_misses(
    pending: torch.Tensor, miss_src: torch.Tensor, miss_dst: torch.Tensor, miss_count: torch.Tensor
) -> None:
    """``pending[miss_dst[b, j]] = miss_src[b, j]`` for ``j < miss_count[b]``: the resolve op's
    miss plan (int32 [B, K], [B, K], [B]) as ``read_rows_from_host`` takes it, in one launch."""
    for what, t in (("miss_src", miss_src), ("miss_dst", miss_dst), ("miss_count", miss_count)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous int32, got {t.dtype}")
    if pending.dtype != torch.int32:
        raise ValueError(f"pending must be int32, got {pending.dtype}")
    B, K = miss_dst.shape
    if B == 0:
        return
    block = 1024
    _stage_misses[(B, triton.cdiv(K, block))](
        pending, miss_src, miss_dst, miss_count, K, block, num_warps=4
    )


def gather_decode(src: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape, int32/int64) of ``src`` (uint8 [N, 656], FP8 layout) decoded to
    bf16 [*ids.shape, 576]: ``decode_rows(src[ids], "fp8", torch.bfloat16)`` in one pass."""
    if src.dtype != torch.uint8 or src.dim() != 2 or src.shape[1] != ROW_BYTES:
        raise ValueError(f"src must be uint8 [rows, {ROW_BYTES}], got {src.dtype} {src.shape}")
    if not src.is_contiguous():
        raise ValueError("src must be contiguous")
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(*ids.shape, KV_DIM, dtype=torch.bfloat16, device=src.device)
    n, block = flat.numel(), 16
    _gather_decode[(triton.cdiv(n, block),)](
        src, src.view(torch.float32), src.view(torch.bfloat16), flat, out, n,
        ROW_BYTES, ROW_BYTES // 4, ROW_BYTES // 2, SCALE_AT, ROPE_AT, LATENT_DIM, ROPE_DIM,
        FP8_TILE, KV_DIM, block, num_warps=4,
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
    block_t: int = 128,
    tiles: int = 1,
    warps: int = 4,
) -> torch.Tensor:
    """sum_h hw[b, h] * relu(q[b, h] . keys[b, t] * scales[b, t]) in float32: q [n, H, D] bf16,
    hw [n, H], keys [n, ctx, D] float8_e4m3fn, scales [n, ctx] float32 (positive) -> [n, ctx]
    float32, the keys read once (no [n, H, ctx] logits). A program scores ``tiles`` tiles of
    ``block_t`` keys with ``warps`` warps (benchmarks/bench_indexer.py compares shapes)."""
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
