"""The DSA indexer's scores over a paged FP8 key cache in one Triton kernel.

    score(t, j) = s_j * sum_h hw'[t, h] * relu(q[t, h] . k8_j)      for j <= position(t)

with ``hw' = hw * H^-1/2 * D^-1/2`` (relu(c x) = c relu(x) for c > 0, so both scales and the
key's positive scale s_j move out of the ReLU). Key j of token t's request lives in block
``block_table[req[t], j // block_size]`` at offset ``j % block_size``; a block holds its keys'
D fp8 values first, their float32 scales after (``hisparse.models.dsa.index_keys``). The keys
are read once, in place; no [tokens, heads, context] logits are written. Positions past a
token's own get -inf, so ``topk`` over a row never picks them.

A program scores ``tiles`` tiles of ``block_t`` keys of one token, loading the token's queries
once. On an H200 (a sweep of 30 shapes, same scores from each) 64-key tiles and 4 warps were
fastest; more tiles per program paid once the grid still held about 8 programs per SM: 16 tiles
at 39 requests x 128k (341 against 378 us for 4), 8 at 30 x 32k (77 against 88), 4 for one
request (40; 8 and 16 tiles left SMs idle). ``tiles_for`` picks so.
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.kernels.rows import triton
from hisparse.models.rows import FP8_MAX

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _paged_scores(
        q, hw, cache_u8, cache_f32, block_table, req, pos, out, L, bt_stride,
        H: tl.constexpr, D: tl.constexpr, KB: tl.constexpr, BS: tl.constexpr,
        BLOCK_T: tl.constexpr, TILES: tl.constexpr, TILE_IN_BLOCK: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        r = tl.load(req + t).to(tl.int64)
        p = tl.load(pos + t)
        h = tl.arange(0, H)
        d = tl.arange(0, D)
        qb = tl.load(q + t * H * D + h[:, None] * D + d[None, :]).to(tl.bfloat16)
        w = tl.load(hw + t * H + h).to(tl.float32)
        for i in tl.range(0, TILES):
            j0 = (tl.program_id(1) * TILES + i) * BLOCK_T
            j = j0 + tl.arange(0, BLOCK_T)
            ok = j <= p
            if TILE_IN_BLOCK:  # one block per tile: its keys are one contiguous run of bytes
                blk = tl.load(block_table + r * bt_stride + j0 // BS, mask=j0 <= p, other=0)
                base = blk.to(tl.int64) * (BS * KB)
                off = j0 % BS + tl.arange(0, BLOCK_T)
                key = cache_u8 + base + off[:, None] * D + d[None, :]
            else:
                blk = tl.load(block_table + r * bt_stride + j // BS, mask=ok, other=0)
                base = blk.to(tl.int64) * (BS * KB)  # the block's first byte: a multiple of 16
                off = j % BS
                key = cache_u8 + base[:, None] + off[:, None] * D + d[None, :]
            k8 = tl.load(key, mask=ok[:, None], other=0)
            k = k8.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
            logits = tl.maximum(tl.dot(k, tl.trans(qb)), 0.0)  # [BLOCK_T, H]
            s = tl.load(cache_f32 + (base + BS * D) // 4 + off, mask=ok, other=0.0)
            val = tl.sum(logits * w[None, :], axis=1) * s
            tl.store(out + t * L + j, tl.where(ok, val, float("-inf")), mask=j < L)


def fits(heads: int, dim: int) -> bool:
    """The kernel's tile shapes: powers of two of at least 16 (tensor-core dot)."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (heads, dim))


def tiles_for(tokens: int, keys: int, block_t: int = 64, programs: int = 1024) -> int:
    """The most tiles per program (16, 8, else 4) that still leave ``programs`` programs."""
    for tiles in (16, 8):
        if tokens * -(-keys // (block_t * tiles)) >= programs:
            return tiles
    return 4


def paged_scores(
    q: torch.Tensor,
    hw: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    req: torch.Tensor,
    positions: torch.Tensor,
    *,
    block_t: int = 64,
    tiles: int | None = None,
    warps: int = 4,
) -> torch.Tensor:
    """q [T, H, D], hw [T, H] (already scaled by H^-1/2 D^-1/2), cache uint8 [blocks,
    block_size * (D + 4)] (fp8 keys, paged), block_table [R, max_blocks], req / positions int [T]
    -> float32 [T, max_blocks * block_size] scores, -inf past each token's position."""
    T, H, D = q.shape
    if not fits(H, D):
        raise ValueError(f"the paged indexer needs powers of two >= 16, got {H} heads x {D}")
    kb = block_size * (D + 4)
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != kb:
        raise ValueError(f"cache must be uint8 [blocks, {kb}] (fp8 keys), got {cache.shape}")
    if block_size % 4:
        raise ValueError(f"fp8 key blocks must hold a multiple of 4 keys, got {block_size}")
    L = block_table.shape[1] * block_size
    tiles = tiles or tiles_for(T, L, block_t)
    out = torch.empty(T, L, dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    bt = block_table.contiguous()
    cache = cache.contiguous()
    grid = (T, triton.cdiv(L, block_t * tiles))
    _paged_scores[grid](
        q.contiguous(), hw.to(torch.float32).contiguous(), cache, cache.view(torch.float32),
        bt, req.contiguous(), positions.contiguous(), out, L, bt.stride(0),
        H, D, D + 4, block_size, block_t, tiles, block_size % block_t == 0, num_warps=warps,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _store_fp8_keys(
        k, k_stride, slots, cache_u8, cache_f32, D: tl.constexpr, BS: tl.constexpr,
        FP8_MAX: tl.constexpr, RCP: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots + t).to(tl.int64)
        if slot >= 0:  # -1: a padding token (vLLM pads a captured batch), nothing to store
            d = tl.arange(0, D)
            x = tl.load(k + t * k_stride + d).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=0)
            # index_keys.encode_keys' arithmetic: times the reciprocal, then a correctly rounded
            # division (Triton's "/" is approximate), so the same bytes on every device.
            scale = tl.where(amax > 0, amax * RCP, 1.0)
            v = tl.math.div_rn(x, scale + tl.zeros([D], tl.float32))
            v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX).to(tl.float8e4nv)
            base = (slot // BS) * (BS * (D + 4))
            off = slot % BS
            tl.store(cache_u8 + base + off * D + d, v.to(tl.uint8, bitcast=True))
            tl.store(cache_f32 + (base + BS * D) // 4 + off, scale)


def store_fp8_keys(cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, block_size: int):
    """``index_keys.store_keys(cache, slots, k, "fp8", block_size)`` in one launch: keys ``k``
    [T, D] (float) quantized at ``slots`` [T] of the paged ``cache``; a slot of -1 is skipped."""
    T, D = k.shape
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != block_size * (D + 4):
        raise ValueError(
            f"cache must be uint8 [blocks, {block_size * (D + 4)}] (fp8 keys), got {cache.shape}"
        )
    if block_size % 4 or D & (D - 1) or slots.shape != (T,):
        raise ValueError(f"fp8 keys need a block of 4n keys, D a power of two, slots [{T}]")
    if T == 0:
        return
    if not cache.is_contiguous():
        raise ValueError("an index key cache must be contiguous (it is written in place)")
    if k.stride(1) != 1:
        k = k.contiguous()
    _store_fp8_keys[(T,)](
        k, k.stride(0), slots.contiguous(), cache, cache.view(torch.float32), D, block_size,
        FP8_MAX, 1.0 / FP8_MAX, num_warps=1,
    )  # fmt: skip
