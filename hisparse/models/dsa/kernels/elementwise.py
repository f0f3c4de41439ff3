"""The small per-token passes around a DSA layer's attention, one Triton launch each: the RMS
norm, the rotary embedding of a 64-value slice, the MLA latent row (latent norm + rotated rope
key), its FP8 row bytes, and the MLP's SiLU gate.

Why: in torch each of these is 7 to 15 elementwise launches (casts, a reduction, products, a
concatenation). A decode step at DeepSeek-V3.2's shapes ran about 60 of them per layer around
the projections, each a few microseconds of a captured step whatever the batch; these kernels
make them 6.

Each matches its torch reference (``hisparse.models.dsa.decoder``, ``hisparse.models.rows``):
the rotary embedding, the row encoding and the gate bit for bit (the same roundings in the same
order, no fused multiply-adds, libdevice's expf), the norms to within their sum's order (a
float32 reduction in another order). Inputs share one dtype (float32 or bfloat16) and device;
``supported`` says when. The interpreter (TRITON_INTERPRET=1) runs all but ``silu_mul``.
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.kernels.rows import ROW_BYTES, triton
from hisparse.models.rows import FP8_MAX, FP8_TILE, KV_DIM, LATENT_DIM, ROPE_DIM

DTYPES = (torch.float32, torch.bfloat16)
# Bit-exactness with torch's elementwise ops: each product rounded before the sum.
_EXACT = {"enable_fp_fusion": False}

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _rms(x, w, N: tl.constexpr, eps):
        """decoder.rms_norm of one row: (x * rsqrt(mean(x^2) + eps)) in x's dtype, times w."""
        x32 = x.to(tl.float32)
        ms = tl.sum(x32 * x32, axis=0) / N
        y = (x32 * tl.math.rsqrt(ms + eps)).to(x.dtype)
        return w.to(tl.float32) * y.to(tl.float32)

    @triton.jit
    def _rms_norm(x, x_stride, w, out, N: tl.constexpr, eps, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < N
        v = tl.load(x + t * x_stride + c, mask=ok, other=0.0)
        g = tl.load(w + c, mask=ok, other=0.0)
        y = _rms(v, g, N, eps)
        tl.store(out + t * N + c, y.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotate(x_at, cs_at, e, INTERLEAVED: tl.constexpr, HALF: tl.constexpr):
        """The 2 * HALF rotated values of the slice at ``x_at`` (first half, second half), as
        rope_interleaved / rope_half compute them, each product rounded to the slice's dtype."""
        if INTERLEAVED:  # pairs (x0, x1), (x2, x3)... -> rotated evens, then rotated odds
            a = tl.load(x_at + 2 * e)
            b = tl.load(x_at + 2 * e + 1)
            c1 = tl.load(cs_at + e)
            s1 = tl.load(cs_at + 2 * HALF + e)
            c2 = c1
            s2 = s1
        else:  # rotate_half: (x1 c1 - x2 s1, x2 c2 + x1 s2) with cos / sin's own halves
            a = tl.load(x_at + e)
            b = tl.load(x_at + HALF + e)
            c1 = tl.load(cs_at + e)
            c2 = tl.load(cs_at + HALF + e)
            s1 = tl.load(cs_at + 2 * HALF + e)
            s2 = tl.load(cs_at + 3 * HALF + e)
        # torch's order: each product rounded to the dtype, then the float32 sum rounded
        dt = a.dtype
        a = a.to(tl.float32)
        b = b.to(tl.float32)
        ac = (a * c1.to(tl.float32)).to(dt).to(tl.float32)
        bs = (b * s1.to(tl.float32)).to(dt).to(tl.float32)
        bc = (b * c2.to(tl.float32)).to(dt).to(tl.float32)
        as_ = (a * s2.to(tl.float32)).to(dt).to(tl.float32)
        return (ac - bs).to(dt), (bc + as_).to(dt)

    @triton.jit
    def _rope_(x, x_t, x_h, cs, start, HEADS: tl.constexpr, INTERLEAVED: tl.constexpr,
               HALF: tl.constexpr):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64) * HEADS + tl.arange(0, HEADS)[:, None]
        at = x + t * x_t + h * x_h + start
        e = tl.arange(0, HALF)[None, :]
        first, second = _rotate(at, cs + t * 4 * HALF, e, INTERLEAVED, HALF)
        # In place, and the interleaved form moves values between threads: every read lands
        # before the first write.
        tl.debug_barrier()
        tl.store(at + e, first)
        tl.store(at + HALF + e, second)

    @triton.jit
    def _latent_row(
        kv, kv_stride, w, cs, out, eps, LAT: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, LAT)
        y = _rms(tl.load(kv + t * kv_stride + c), tl.load(w + c), LAT, eps)
        dst = out + t * (LAT + 2 * HALF)
        tl.store(dst + c, y.to(out.dtype.element_ty))
        e = tl.arange(0, HALF)
        first, second = _rotate(kv + t * kv_stride + LAT, cs + t * 4 * HALF, e, True, HALF)
        tl.store(dst + LAT + e, first)
        tl.store(dst + LAT + HALF + e, second)

    @triton.jit
    def _encode_fp8(
        kv, kv_stride, out_u8, out_f32, out_bf16, RCP: tl.constexpr, FMAX: tl.constexpr,
        LAT: tl.constexpr, TILE: tl.constexpr, ROPE: tl.constexpr, ROW: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        NT: tl.constexpr = LAT // TILE
        i = tl.arange(0, NT)[:, None] * TILE + tl.arange(0, TILE)[None, :]
        x = tl.load(kv + t * kv_stride + i)  # [tiles, TILE]
        # rows.encode_rows' arithmetic: the scale in x's dtype (amax times the reciprocal), a
        # correctly rounded division rounded to x's dtype, clamped, then to fp8.
        amax = tl.max(tl.abs(x), axis=1).to(tl.float32)
        scale = tl.where(amax > 0, (amax * RCP).to(x.dtype).to(tl.float32), 1.0)
        v = tl.math.div_rn(x.to(tl.float32), scale[:, None] + tl.zeros_like(x.to(tl.float32)))
        v = tl.minimum(tl.maximum(v.to(x.dtype).to(tl.float32), -FMAX), FMAX)
        tl.store(out_u8 + t * ROW + i, v.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        tl.store(out_f32 + t * (ROW // 4) + LAT // 4 + tl.arange(0, NT), scale)
        e = tl.arange(0, ROPE)
        rope = tl.load(kv + t * kv_stride + LAT + e).to(tl.float32).to(tl.bfloat16)
        tl.store(out_bf16 + t * (ROW // 2) + (LAT + 4 * NT) // 2 + e, rope)


if triton is not None:

    @triton.jit
    def _silu_mul(g, g_stride, u, u_stride, out, N, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < N
        a = tl.load(g + t * g_stride + c, mask=ok, other=0.0)
        dt = a.dtype
        # torch's silu: x / (1 + expf(-x)) in float32 (libdevice's expf, a rounded division)
        x = a.to(tl.float32)
        s = tl.math.div_rn(x, 1.0 + libdevice.exp(-x)).to(dt).to(tl.float32)
        b = tl.load(u + t * u_stride + c, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + t * N + c, (s * b).to(dt), mask=ok)


def supported(*tensors: torch.Tensor) -> bool:
    """The kernels run: Triton, one CUDA device, one dtype among ``DTYPES``."""
    t0 = tensors[0]
    return (
        triton is not None
        and t0.device.type == "cuda"
        and t0.dtype in DTYPES
        and all(t.dtype == t0.dtype and t.device == t0.device for t in tensors)
    )


def _cos_sin(cos: torch.Tensor, sin: torch.Tensor, tokens: int) -> torch.Tensor:
    if cos.shape != (tokens, ROPE_DIM) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{tokens}, {ROPE_DIM}], got {cos.shape} {sin.shape}")
    return torch.cat([cos, sin], dim=-1)  # one [T, 128] read per token


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``decoder.rms_norm(x, weight, eps)`` for x [T, N] (rows may be strided)."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm takes x [T, N] (unit stride) and weight [N], got {x.shape}")
    n = x.shape[1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm[(x.shape[0],)](
            x, x.stride(0), weight.contiguous(), out, n, eps, block,
            num_warps=max(1, min(8, block // 512)),
        )  # fmt: skip
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for [T, N] operands (rows may be strided): a new [T, N]."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"silu_mul takes gate and up [T, N] (unit stride), got {gate.shape}")
    T, n = gate.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    block = 1024
    if T:
        _silu_mul[(T, triton.cdiv(n, block))](
            gate, gate.stride(0), up, up.stride(0), out, n, block, num_warps=4, **_EXACT
        )
    return out


def rope_(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, start: int, interleaved: bool
) -> torch.Tensor:
    """x [T, H, D] (last dim unit stride) with its 64 values at ``start`` rotated in place
    (``rope_interleaved`` or ``rope_half``); the rest is not touched. Returns x.

    In place because the callers rotate a projection's fresh output: the copying form moved all
    D values to rotate 64, and its launches took 11 us per layer at 64 requests (H200)."""
    if x.dim() != 3 or x.stride(2) != 1 or not 0 <= start <= x.shape[2] - ROPE_DIM:
        raise ValueError(f"rope_ takes x [T, H, D >= start + 64] (unit stride), got {x.shape}")
    T, H, _ = x.shape
    cs = _cos_sin(cos, sin, T)
    heads = min(16, H & -H)  # a power of two dividing H: no program reads past the last head
    if T and H:
        _rope_[(T, H // heads)](
            x, x.stride(0), x.stride(1), cs, start, heads, interleaved, ROPE_DIM // 2,
            num_warps=max(1, heads // 4), **_EXACT,
        )  # fmt: skip
    return x


def latent_row(
    kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``latent_row(rms_norm(kv[:, :512]), rope_interleaved(kv[:, 512:]))``: kv_a_proj's output
    [T, 576] -> the row values [T, 576]."""
    if kv.dim() != 2 or kv.shape[1] != KV_DIM or kv.stride(1) != 1:
        raise ValueError(f"kv must be [T, {KV_DIM}] (unit stride), got {kv.shape}")
    cs = _cos_sin(cos, sin, kv.shape[0])
    out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
    if kv.shape[0]:
        _latent_row[(kv.shape[0],)](
            kv, kv.stride(0), norm_weight.contiguous(), cs, out, eps, LATENT_DIM, ROPE_DIM // 2,
            num_warps=2, **_EXACT,
        )  # fmt: skip
    return out


def encode_fp8_rows(kv: torch.Tensor) -> torch.Tensor:
    """``rows.encode_rows(kv, "fp8")`` for kv [T, 576]: uint8 [T, 656], the same bytes."""
    if kv.dim() != 2 or kv.shape[1] != KV_DIM or kv.stride(1) != 1:
        raise ValueError(f"kv must be [T, {KV_DIM}] (unit stride), got {kv.shape}")
    out = torch.empty(kv.shape[0], ROW_BYTES, dtype=torch.uint8, device=kv.device)
    if kv.shape[0]:
        _encode_fp8[(kv.shape[0],)](
            kv, kv.stride(0), out, out.view(torch.float32), out.view(torch.bfloat16),
            1.0 / FP8_MAX, FP8_MAX, LATENT_DIM, FP8_TILE, ROPE_DIM, ROW_BYTES, num_warps=2,
            **_EXACT,
        )  # fmt: skip
    return out
