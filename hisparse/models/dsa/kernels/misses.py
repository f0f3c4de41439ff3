"""A HiSparse step's misses fetched by attention's row read itself ("in-read"), not copied into
the hot buffer by a gather first.

The resolve op's miss plan (per request: host key -> hot row) is written into a ``pending``
table (``pending[hot row] = host key``); the row read then takes a pending row from the pinned
host pool over PCIe, beside the hits it reads from HBM, decodes both exactly as
``rows.gather_decode`` does, and writes the fetched bytes to their hot row for later steps; the
table is emptied again by the same plan.

Why: a gather ahead of the read leaves the read waiting on the whole PCIe copy. Inside the read
the PCIe fetch overlaps the HBM reads of the other rows: on an H200 at 32k context HiSparse's
step cost 1.08x resident at batch 64 and 1.10x at 112 this way, against 1.14x and 1.21x with
the gather first (docs/experiments.md, the retired graph engine), and the in-read carried the
128k capacity to 3.10x. At a batch of one the gather was a little faster (1.026x vs 1.040x).

The table is emptied by a launch of its own, not by the read: Triton may give several warps
their own copy of one row's load, so a read that retired its entries could race with itself.
"""

from __future__ import annotations

import torch

from hisparse.models.dsa.kernels.rows import ROPE_AT, ROW_BYTES, SCALE_AT, check_rows, triton
from hisparse.models.rows import FP8_TILE, KV_DIM, LATENT_DIM, ROPE_DIM
from hisparse.runtime.host_pool import HostPointer

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _read_with_misses(
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
        t = tl.arange(0, TILES)
        lat = t[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :]
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
        # The fetched bytes into their hot rows: later steps hit them there.
        tl.store(hot_q, q, mask=m3)
        tl.store(hot_s, s, mask=m2)
        tl.store(hot_e, rope, mask=m2)
        # As gather_decode decodes: exact fp8 -> float, the scale rounded to bf16, one float
        # product rounded to bf16.
        qf = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sf = s.to(tl.bfloat16).to(tl.float32)[:, :, None]
        dst = out + r.to(tl.int64)[:, None, None] * OUT_W
        tl.store(dst + lat, (qf * sf).to(tl.bfloat16), mask=ok[:, None, None])
        tl.store(out + r.to(tl.int64)[:, None] * OUT_W + TILES * TILE + e[None, :], rope,
                 mask=ok[:, None])  # fmt: skip

    @triton.jit
    def _stage(
        pending, miss_src, miss_dst, miss_count, K, BLOCK: tl.constexpr, CLEAR: tl.constexpr
    ):
        b = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        used = j < tl.load(miss_count + b)
        at = b.to(tl.int64) * K + j
        dst = tl.load(miss_dst + at, mask=used, other=0)
        if CLEAR:
            tl.store(pending + dst, -1, mask=used)
        else:
            tl.store(pending + dst, tl.load(miss_src + at, mask=used, other=0), mask=used)


def _HostRows(t: torch.Tensor, dtype: torch.dtype) -> HostPointer:
    """The pinned host rows ``t`` as the kernel reads them (tests under Triton's interpreter
    swap this for a view)."""
    return HostPointer(t.data_ptr(), dtype)


def stage_misses(pending, miss_src, miss_dst, miss_count, *, clear: bool = False) -> None:
    """``pending[miss_dst[b, j]] = miss_src[b, j]`` for ``j < miss_count[b]`` (the resolve op's
    plan: int32 [B, K], [B, K], [B]) in one launch; ``clear`` sets those entries back to -1."""
    for what, t in (("miss_src", miss_src), ("miss_dst", miss_dst), ("miss_count", miss_count)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous int32, got {t.dtype}")
    if pending.dtype != torch.int32:
        raise ValueError(f"pending must be int32, got {pending.dtype}")
    B, K = miss_dst.shape
    if B == 0 or K == 0:
        return
    block = 1024
    grid = (B, triton.cdiv(K, block))
    _stage[grid](pending, miss_src, miss_dst, miss_count, K, block, clear, num_warps=4)


def read_with_misses(
    hot: torch.Tensor,
    host: torch.Tensor,
    pending: torch.Tensor,
    ids: torch.Tensor,
    *,
    block: int = 64,
    warps: int = 8,
) -> torch.Tensor:
    """``gather_decode(hot, ids)`` as it would read after the misses' copy: a row ``h`` with
    ``pending[h] = key >= 0`` is read from ``host[key]`` (pinned, uint8 [N, 656]) and its bytes
    are written to ``hot[h]``. ``block`` rows and ``warps`` warps per program: on an H200 five
    shapes lay within 4 % of each other at batches 64 and 112, the PCIe fetch setting the time."""
    check_rows(hot=hot, host=host, pinned=("host",))
    if pending.dtype != torch.int32 or pending.numel() < hot.shape[0]:
        raise ValueError(f"pending must be int32 with >= {hot.shape[0]} entries (one per hot row)")
    flat = ids.reshape(-1).contiguous()
    out = torch.empty(*ids.shape, KV_DIM, dtype=torch.bfloat16, device=hot.device)
    n = flat.numel()
    if n == 0:
        return out
    hv = [_HostRows(host, d) for d in (torch.uint8, torch.float32, torch.bfloat16)]
    _read_with_misses[(triton.cdiv(n, block),)](
        hot, hot.view(torch.float32), hot.view(torch.bfloat16), *hv, pending, flat, out, n,
        ROW_BYTES, ROW_BYTES // 4, ROW_BYTES // 2, SCALE_AT, ROPE_AT, ROPE_DIM,
        LATENT_DIM // FP8_TILE, FP8_TILE, KV_DIM, block, num_warps=warps,
    )  # fmt: skip
    return out
