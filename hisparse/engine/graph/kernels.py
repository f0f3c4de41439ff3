"""The contiguous-key DSA indexer kernel of the GPU-bound step (keys [n, ctx, D] fp8 with
scales [n, ctx]), and the switch between the Triton kernels and the torch path. The row read is
``hisparse.models.dsa.kernels.rows`` (shared with the model core).
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.kernels.rows import (  # noqa: F401 - the step's names for them
    ROPE_AT,
    ROW_BYTES,
    SCALE_AT,
    available,
    check_rows,
    gather_decode,
    triton,
)

if triton is not None:
    import triton.language as tl


def use_triton(fused, device) -> bool:
    """Whether a step on ``device`` runs the Triton kernels: ``fused`` None means wherever they
    can; True where they cannot is refused by name."""
    can = available(device)
    if fused and not can:
        raise ValueError(f"fused=True needs Triton and a CUDA device; the KV is on {device}")
    return can if fused is None else bool(fused)


if triton is not None:

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
