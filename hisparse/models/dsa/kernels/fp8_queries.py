"""DeepGEMM's indexer inputs in one Triton launch, and its mask in another.

Why: the torch that fed DeepGEMM's paged logits (``prepare_torch``: the per-head FP8 query
quantization, the lengths, the block table rows, then the mask after) was 17 small
launches around DeepGEMM's two; at 1 token x 16k keys on an H200 they made its call 31 us
against the Triton kernel's 7. ``prepare`` writes the same bytes, ``mask_past`` the same -inf:
the quantization is ``index_keys.encode_keys``' arithmetic (the scale times the reciprocal, a
correctly rounded division, the clamp, then to fp8), as ``quantize_queries`` has it.
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.kernels.rows import triton
from hisparse.models.rows import FP8_MAX

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _prepare(
        q, q_t, q_h, hw, pos, req, table, table_t, q8, w, lens, bt, NB, H, D,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
        RCP: tl.constexpr, FMAX: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        ok = (h[:, None] < H) & (d[None, :] < D)
        x = tl.load(q + t * q_t + h[:, None] * q_h + d[None, :], mask=ok, other=0.0)
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.where(amax > 0, amax * RCP, 1.0)
        v = tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x))
        v = tl.minimum(tl.maximum(v, -FMAX), FMAX).to(tl.float8e4nv)
        tl.store(q8 + (t * H + h[:, None]) * D + d[None, :], v.to(tl.uint8, bitcast=True), mask=ok)
        g = tl.load(hw + t * H + h, mask=h < H, other=0.0).to(tl.float32)
        tl.store(w + t * H + h, g * scale, mask=h < H)
        tl.store(lens + t, (tl.load(pos + t) + 1).to(tl.int32))
        r = tl.load(req + t).to(tl.int64)
        for b0 in tl.range(0, NB, BLOCK_B):
            b = b0 + tl.arange(0, BLOCK_B)
            blk = tl.load(table + r * table_t + b, mask=b < NB, other=0)
            tl.store(bt + t * NB + b, blk.to(tl.int32), mask=b < NB)

    @triton.jit
    def _mask_past(out, out_t, pos, L, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        past = (j > tl.load(pos + t)) & (j < L)
        tl.store(out + t * out_t + j, tl.full([BLOCK], float("-inf"), tl.float32), mask=past)


def quantize_queries(q: torch.Tensor, hw: torch.Tensor):
    """q [T, H, D] -> (fp8 q, hw [T, H] times each head's scale), one scale per token and head."""
    x = q.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    q8 = (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q8.contiguous(), (hw.float() * scale.squeeze(-1)).contiguous()


def prepare_torch(q, hw, block_table, req, positions) -> tuple:
    """(fp8 q [T, H, D], weights float32 [T, H], lens int32 [T, 1], block table rows int32
    [T, max_blocks]): DeepGEMM's inputs for tokens of requests ``req`` at ``positions``."""
    q8, w = quantize_queries(q, hw)
    lens = (positions + 1).to(torch.int32).view(-1, 1)
    return q8, w, lens, block_table.index_select(0, req).to(torch.int32)


def prepare(q, hw, block_table, req, positions) -> tuple:
    """``prepare_torch`` in one launch, the same bits."""
    T, H, D = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    nb = block_table.shape[1]
    q8 = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=q.device)
    w = torch.empty(T, H, dtype=torch.float32, device=q.device)
    lens = torch.empty(T, 1, dtype=torch.int32, device=q.device)
    bt = torch.empty(T, nb, dtype=torch.int32, device=q.device)
    if T:
        _prepare[(T,)](
            q, q.stride(0), q.stride(1), hw.contiguous(), positions.contiguous(),
            req.contiguous(), block_table, block_table.stride(0), q8.view(torch.uint8), w, lens,
            bt, nb, H, D, triton.next_power_of_2(H), triton.next_power_of_2(D),
            min(1024, triton.next_power_of_2(max(nb, 1))), 1.0 / FP8_MAX, FP8_MAX, num_warps=4,
            enable_fp_fusion=False,  # each product rounded, as torch's
        )  # fmt: skip
    return q8, w, lens, bt


def mask_past_torch(out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``out`` [T, L] with -inf at each column past its row's position, in place."""
    past = torch.arange(out.shape[1], device=out.device) > positions.view(-1, 1)
    return out.masked_fill_(past, float("-inf"))


def mask_past(out: torch.Tensor, positions: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``mask_past_torch`` in one launch (float32 ``out``, rows may be strided)."""
    if out.dtype != torch.float32 or out.dim() != 2 or out.stride(1) != 1:
        raise ValueError(f"mask_past takes float32 [T, L] (unit stride), got {out.shape}")
    T, L = out.shape
    if T and L:
        grid = (T, triton.cdiv(L, block))
        _mask_past[grid](out, out.stride(0), positions.contiguous(), L, block, num_warps=4)
    return out
