"""Sparse MLA decode in one Triton kernel: each request's selected FP8 rows are read by id,
decoded, scored against the absorbed query and mixed by an online softmax, so neither the bf16
rows [n, top_k, 576] nor the scores [n, heads, top_k] are ever written to memory.

Why: at batch 112 the row read, the two batched products over the materialized rows and the
softmax over the materialized scores are about half of the per-request cost of a decode step
(benchmarks/results/step_kernels_h200.md), the cost that bounds throughput at HiSparse's
capacity. The rows are decoded exactly as ``gather_decode`` does (the same bf16 values); the
scores and the softmax stay in float32, so the result is as accurate as the products over
materialized rows, not bit-identical to them. Resident and HiSparse call the same kernel on the
same rows in the same order, so parity between them holds.

A program takes ``heads_per_program`` heads of one request over all its rows, ``block`` rows at
a time; every head block re-reads and re-decodes the request's rows (from L2 after the first).
The defaults, 64 heads x 16 rows x 8 warps x 2 stages, are what compiles for sm_90 with Hopper's
warpgroup MMA and the fewest register spills of the shapes tried
(benchmarks/results/triton_kernels_sm90.md). On an H200 (benchmarks/results/mla_h200.json)
64 x 32 x 8 x 2 was the fastest shape alone from batch 30 to 64 (187 against 326 us for the bmm
path at 30) but slower than the bmm path at 112; in the engine the default made every mode's step
slower (engine_tpot_fused_attention_h200.md), so "bmm" stays the step's default.

``bmm_attention`` is that path: the row read (fetching a deferred plan's misses), two batched
products and ``masked_softmax``.
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.kernels import misses as misses_kernels
from hisparse.models.dsa.kernels.rows import (
    ROPE_AT,
    ROW_BYTES,
    SCALE_AT,
    check_rows,
    gather_decode,
    triton,
)
from hisparse.models.rows import FP8_TILE, LATENT_DIM, ROPE_DIM

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _sparse_mla(
        q, src_u8, src_f32, src_bf16, ids, out, part_acc, part_ml, K, CHUNK, scale,
        H: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr,
        ROW_U8: tl.constexpr, ROW_F32: tl.constexpr, ROW_BF16: tl.constexpr,
        SCALE0: tl.constexpr, ROPE0: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr,
        TILE: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        c = tl.arange(0, LAT)
        e = tl.arange(0, ROPE)
        hm = (h < H)[:, None]  # a head block may pass the last head (fewer than 16 heads)
        t = tl.arange(0, LAT // TILE)
        lat3 = t[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :]
        q_row = q + (b * H + h)[:, None] * (LAT + ROPE)
        q_lat = tl.load(q_row + c[None, :], mask=hm, other=0.0).to(DOT)  # [HB, LAT]
        q_rope = tl.load(q_row + LAT + e[None, :], mask=hm, other=0.0).to(DOT)  # [HB, ROPE]
        m_i = tl.full([HB], float("-inf"), tl.float32)
        l_i = tl.zeros([HB], tl.float32)
        acc = tl.zeros([HB, LAT], tl.float32)
        split = tl.program_id(2)
        end = tl.minimum((split + 1) * CHUNK, K)
        for k0 in range(split * CHUNK, end, BN):
            j = k0 + tl.arange(0, BN)
            row = tl.load(ids + b * K + j, mask=j < end, other=-1).to(tl.int64)
            ok = row >= 0  # -1: padding (fewer visible rows than top_k), weight 0
            row = tl.maximum(row, 0)
            # The latent as [BN, tiles, TILE] beside one scale per tile: a scale is loaded once,
            # not once per value.
            k8 = tl.load(src_u8 + row[:, None, None] * ROW_U8 + lat3, mask=ok[:, None, None],
                         other=0)  # fmt: skip
            ks = tl.load(src_f32 + row[:, None] * ROW_F32 + SCALE0 + t[None, :], mask=ok[:, None],
                         other=0.0)  # fmt: skip
            # The values gather_decode gives: exact fp8 -> float, the scale rounded to bf16, one
            # float product rounded to bf16.
            kf = k8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            kf = kf * ks.to(tl.bfloat16).to(tl.float32)[:, :, None]
            k_lat = tl.reshape(kf.to(tl.bfloat16), [BN, LAT]).to(DOT)  # [BN, LAT]
            k_rope = tl.load(src_bf16 + row[:, None] * ROW_BF16 + ROPE0 + e[None, :],
                             mask=ok[:, None], other=0.0).to(DOT)  # fmt: skip
            s = tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_rope, tl.trans(k_rope))  # [HB, BN]
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A run of padding only (a short context cut into splits) leaves the max at -inf:
            # subtract 0 there, so its weights are exp(-inf) = 0, not exp(-inf + inf) = nan.
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_sub[:, None])
            alpha = tl.exp(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), k_lat)
            m_i = m_new
        if SPLITS == 1:
            mix = (acc / l_i[:, None]).to(tl.bfloat16)
            tl.store(out + (b * H + h)[:, None] * LAT + c[None, :], mix, mask=hm)
        else:  # this split's unnormalized sum, its max and its denominator, for _combine
            at = (b * H + h) * SPLITS + split
            tl.store(part_acc + at[:, None] * LAT + c[None, :], acc, mask=hm)
            tl.store(part_ml + at * 2, m_i, mask=h < H)
            tl.store(part_ml + at * 2 + 1, l_i, mask=h < H)

    @triton.jit
    def _combine(
        part_acc, part_ml, out, H: tl.constexpr, HB: tl.constexpr, SPLITS: tl.constexpr,
        LAT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        hm = h < H
        c = tl.arange(0, LAT)
        base = (b * H + h) * SPLITS
        m_all = tl.full([HB], float("-inf"), tl.float32)
        for s in tl.static_range(SPLITS):
            m_all = tl.maximum(m_all, tl.load(part_ml + (base + s) * 2, mask=hm, other=0.0))
        acc = tl.zeros([HB, LAT], tl.float32)
        den = tl.zeros([HB], tl.float32)
        for s in tl.static_range(SPLITS):
            # A split with no rows has max -inf and weight 0.
            w = tl.exp(tl.load(part_ml + (base + s) * 2, mask=hm, other=0.0) - m_all)
            den += w * tl.load(part_ml + (base + s) * 2 + 1, mask=hm, other=0.0)
            a = tl.load(part_acc + (base + s)[:, None] * LAT + c[None, :], mask=hm[:, None],
                        other=0.0)  # fmt: skip
            acc += w[:, None] * a
        den = tl.where(hm, den, 1.0)  # heads past the last: nothing was summed
        mix = (acc / den[:, None]).to(tl.bfloat16)
        tl.store(out + (b * H + h)[:, None] * LAT + c[None, :], mix, mask=hm[:, None])

    @triton.jit
    def _masked_softmax(s, ids, out, H, K, HB: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HB + tl.arange(0, HB)
        j = tl.arange(0, BLOCK)
        ok = tl.load(ids + t * K + j, mask=j < K, other=-1) >= 0
        at = (t * H + h)[:, None] * K + j[None, :]
        m2 = (h < H)[:, None] & (j < K)[None, :]
        x = tl.load(s + at, mask=m2, other=0.0).to(tl.float32)
        x = tl.where(ok[None, :], x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = tl.math.div_rn(e, tl.sum(e, axis=1)[:, None] + tl.zeros_like(e))
        tl.store(out + at, p.to(out.dtype.element_ty), mask=m2)


def masked_softmax(s: torch.Tensor, ids: torch.Tensor, heads_per_program: int = 4):
    """softmax over the last dim of scores ``s`` [T, H, K] with the entries whose ``ids`` [T, K]
    are -1 (padding) left out, in one pass: torch's masked_fill with a mask broadcast over heads
    was a slow strided pass (75 us per layer at batch 30 on an H200) before its softmax. Float32
    inside, ``s``'s dtype out. Every row needs one entry that is not padding."""
    T, H, K = s.shape
    if ids.shape != (T, K):
        raise ValueError(f"ids must be [{T}, {K}], got {tuple(ids.shape)}")
    s = s.contiguous()
    out = torch.empty_like(s)
    if T == 0 or H == 0:
        return out
    block = triton.next_power_of_2(K)
    warps = 8 if block * heads_per_program >= 4096 else 4
    _masked_softmax[(T, triton.cdiv(H, heads_per_program))](
        s, ids.contiguous(), out, H, K, heads_per_program, block, num_warps=warps
    )
    return out


MAX_SPLITS = 16
PRODUCTS = {"bf16": tl.bfloat16, "fp32": tl.float32} if triton is not None else {}


def sparse_mla(
    q: torch.Tensor,
    src: torch.Tensor,
    ids: torch.Tensor,
    scale: float,
    *,
    heads_per_program: int = 64,
    block: int = 16,
    warps: int = 8,
    stages: int = 2,
    splits: int = 1,
    products: str = "bf16",
) -> torch.Tensor:
    """softmax(scale * q . k_t) . k_t[:512] over the rows ``ids`` [n, top_k] of ``src`` (uint8
    [N, 656], FP8 layout; an id of -1 is padding and takes no part): q [n, heads, 576] bf16 ->
    latent mix [n, heads, 512] bf16. Every request needs at least one row that is not padding.
    ``products="fp32"`` takes both products on float32 operands (the same values, widened): what
    Triton's CPU interpreter can run, whose bf16 products are wrong; slow on a GPU.
    ``splits`` > 1 cuts each request's rows into that many runs scored by programs of their own,
    then merged (flash-decoding): more programs where the batch is small. The split changes the
    order of the sums, so every part of a step must use the same value (``splits_for``)."""
    if products not in PRODUCTS:
        raise ValueError(f"products must be one of {tuple(PRODUCTS)}, got {products!r}")
    check_rows(src=src)
    n, H, D = q.shape
    if q.dtype != torch.bfloat16 or D != LATENT_DIM + ROPE_DIM:
        raise ValueError(f"q must be bfloat16 [n, heads, {LATENT_DIM + ROPE_DIM}], got {q.dtype}")
    if ids.dim() != 2 or ids.shape[0] != n:
        raise ValueError(f"ids must be [{n}, top_k], got {tuple(ids.shape)}")
    if heads_per_program < 16 or heads_per_program & (heads_per_program - 1):
        raise ValueError(f"heads_per_program must be a power of two >= 16, got {heads_per_program}")
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must lie in [1, {MAX_SPLITS}], got {splits}")
    q, ids = q.contiguous(), ids.contiguous()
    out = torch.empty(n, H, LATENT_DIM, dtype=torch.bfloat16, device=q.device)
    if n == 0:
        return out
    K = ids.shape[1]
    chunk = triton.cdiv(triton.cdiv(K, splits), block) * block
    part_acc = part_ml = out  # unused unless split
    if splits > 1:
        part_acc = torch.empty(n * H * splits, LATENT_DIM, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(n * H * splits * 2, dtype=torch.float32, device=q.device)
    _sparse_mla[(n, triton.cdiv(H, heads_per_program), splits)](
        q, src, src.view(torch.float32), src.view(torch.bfloat16), ids, out, part_acc, part_ml,
        K, chunk, float(scale), H, heads_per_program, block, splits,
        ROW_BYTES, ROW_BYTES // 4, ROW_BYTES // 2, SCALE_AT, ROPE_AT, LATENT_DIM, ROPE_DIM,
        FP8_TILE, PRODUCTS[products], num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        _combine[(n, triton.cdiv(H, 16))](
            part_acc, part_ml, out, H, 16, splits, LATENT_DIM, num_warps=8
        )
    return out


def splits_for(batch: int, heads: int, device, heads_per_program: int = 64) -> int:
    """How many runs to cut each request's rows into so that a step of ``batch`` requests fills
    the device's SMs once (1 from about a third of the SM count up)."""
    device = torch.device(device)
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 132
    )
    programs = batch * -(-heads // heads_per_program)
    return max(1, min(MAX_SPLITS, -(-sms // programs)))


def bmm_attention(q, src, ids, scale, misses=None) -> torch.Tensor:
    """The row read (fetching a deferred plan's misses), two batched products and the masked
    softmax: q [T, H, 576] bf16 over rows ``ids`` [T, K] of ``src`` -> [T, H, 512] bf16."""
    if misses is None:
        kv = gather_decode(src, ids.clamp(min=0))  # [T, K, 576] bf16
    else:
        plan = (misses.src, misses.dst, misses.count)
        misses_kernels.stage_misses(misses.pending, *plan)
        kv = misses_kernels.read_with_misses(src, misses.host, misses.pending, ids.clamp(min=0))
        misses_kernels.stage_misses(misses.pending, *plan, clear=True)
    s = torch.baddbmm(
        q.new_empty(q.shape[0], q.shape[1], ids.shape[1]),
        q,
        kv.transpose(1, 2),
        beta=0.0,
        alpha=scale,
    )
    return torch.bmm(masked_softmax(s, ids), kv[..., :LATENT_DIM])
