"""How a HiSparse part's misses reach attention's row read in the GPU-bound step, besides the
resolve op's own gather: Triton kernels over the op's miss plan (miss_src, miss_dst, miss_count).

* ``stage_misses`` writes the plan into a ``pending`` table (``pending[hot row]`` = its host key)
  in one launch, and with ``clear=True`` empties those entries again after the read. (A read
  that retired its own entries would need every warp's load of the entry to come before the
  retirement, and Triton may give several warps their own copy of one row's load; an H200 run
  of that form lost parity. A launch of its own needs no such ordering.)
* ``read_rows_from_host`` ("in-read"): attention's row read itself reads a pending row from the
  pinned host pool over PCIe, beside the hits read from HBM, and writes it to its hot row.
  With ``part="misses"`` it reads only the pending rows ("read beside"): on a side stream, while
  ``kernels.gather_decode(part="hits")`` decodes the others from HBM into the same output, so no
  warp of the hits' read waits on PCIe. ``read_rows_apart`` does the same in one launch: some
  of its programs read only the pending rows, the others only the hot ones.
* ``copy_misses`` ("beside"): the plan copied host -> hot rows by SM loads on a side stream
  while ``kernels.gather_decode(part="hits")`` decodes the rows already hot; after the copy,
  ``part="misses"`` decodes the rest. The PCIe transfer then runs under the query projection
  and the hits' read.

Each gives bytes identical to the op's gather, and the row read decodes them as ``gather_decode``
does, so every path stays bit-identical to resident.
"""

from __future__ import annotations

import torch

from hisparse.engine.graph.kernels import (
    ROPE_AT,
    ROW_BYTES,
    SCALE_AT,
    _gather_rows,
    check_rows,
    decoded_rows,
    triton,
)
from hisparse.models.rows import FP8_TILE, KV_DIM, LATENT_DIM, ROPE_DIM

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _fetch_rows(
        r, h, k, miss, hit, hot_u8, hot_f32, hot_bf16, host_u8, host_f32, host_bf16, out,
        ROW_U8: tl.constexpr, ROW_F32: tl.constexpr, ROW_BF16: tl.constexpr,
        SCALE0: tl.constexpr, ROPE0: tl.constexpr, ROPE: tl.constexpr, TILES: tl.constexpr,
        TILE: tl.constexpr, OUT_W: tl.constexpr, MISSES_ONLY: tl.constexpr,
    ):  # fmt: skip
        # Output rows r: where `miss`, host row k (its bytes also into hot row h); where `hit`,
        # hot row h (MISSES_ONLY: no such rows here).
        ok = miss | hit
        k = tl.where(miss, k, 0).to(tl.int64)
        h = h.to(tl.int64)
        t = tl.arange(0, TILES)
        j = tl.arange(0, TILE)
        lat = t[None, :, None] * TILE + j[None, None, :]
        m3, h3 = miss[:, None, None], hit[:, None, None]
        hot_q = hot_u8 + h[:, None, None] * ROW_U8 + lat
        m2, h2 = miss[:, None], hit[:, None]
        hot_s = hot_f32 + h[:, None] * ROW_F32 + SCALE0 + t[None, :]
        e = tl.arange(0, ROPE)
        hot_e = hot_bf16 + h[:, None] * ROW_BF16 + ROPE0 + e[None, :]
        q = tl.load(host_u8 + k[:, None, None] * ROW_U8 + lat, mask=m3, other=0)
        s = tl.load(host_f32 + k[:, None] * ROW_F32 + SCALE0 + t[None, :], mask=m2)
        rope = tl.load(host_bf16 + k[:, None] * ROW_BF16 + ROPE0 + e[None, :], mask=m2)
        if not MISSES_ONLY:
            q = tl.where(m3, q, tl.load(hot_q, mask=h3, other=0))
            s = tl.where(m2, s, tl.load(hot_s, mask=h2))
            rope = tl.where(m2, rope, tl.load(hot_e, mask=h2))
        # The missed rows' bytes into their hot rows: later steps hit them there.
        tl.store(hot_q, q, mask=m3)
        tl.store(hot_s, s, mask=m2)
        tl.store(hot_e, rope, mask=m2)
        qf = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sf = s.to(tl.bfloat16).to(tl.float32)[:, :, None]
        dst = out + r.to(tl.int64)[:, None, None] * OUT_W
        tl.store(dst + lat, (qf * sf).to(tl.bfloat16), mask=ok[:, None, None])
        tl.store(out + r.to(tl.int64)[:, None] * OUT_W + TILES * TILE + e[None, :], rope,
                 mask=ok[:, None])  # fmt: skip

    @triton.jit
    def _read_host_misses(
        hot_u8, hot_f32, hot_bf16, host_u8, host_f32, host_bf16, pending, ids, out, n,
        ROW_U8: tl.constexpr, ROW_F32: tl.constexpr, ROW_BF16: tl.constexpr,
        SCALE0: tl.constexpr, ROPE0: tl.constexpr, ROPE: tl.constexpr, TILES: tl.constexpr,
        TILE: tl.constexpr, OUT_W: tl.constexpr, BLOCK: tl.constexpr, MISSES_ONLY: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = r < n
        h = tl.load(ids + r, mask=ok, other=0)
        k = tl.load(pending + h, mask=ok, other=-1)
        hit = ok & (k < 0)
        if MISSES_ONLY:
            hit = hit & (r < 0)
        _fetch_rows(
            r, h, k, ok & (k >= 0), hit, hot_u8, hot_f32, hot_bf16, host_u8, host_f32, host_bf16,
            out, ROW_U8, ROW_F32, ROW_BF16, SCALE0, ROPE0, ROPE, TILES, TILE, OUT_W, MISSES_ONLY,
        )  # fmt: skip

    @triton.jit
    def _read_apart(
        hot_u8, hot_f32, hot_bf16, host_u8, host_f32, host_bf16, pending, ids, out, n,
        miss_src, miss_dst, miss_count, slot_of, B, K, T,
        ROW_U8: tl.constexpr, ROW_F32: tl.constexpr, ROW_BF16: tl.constexpr,
        SCALE0: tl.constexpr, ROPE0: tl.constexpr, ROPE: tl.constexpr, TILES: tl.constexpr,
        TILE: tl.constexpr, OUT_W: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        # Programs [0, T) walk the miss plan, CHUNK misses at a time, each into its hot row and
        # its output row slot_of[hot row]; the others read the hot rows, BLOCK per program, as
        # gather_decode(part="hits") does. Programs start in order, so the PCIe reads begin
        # first, and no program that reads HBM waits on PCIe.
        pid = tl.program_id(0)
        if pid < T:
            for b in range(pid, B, T):
                count = tl.load(miss_count + b)
                for c in range(0, count, CHUNK):
                    i = c + tl.arange(0, CHUNK)
                    used = i < count
                    at = (b * K + i).to(tl.int64)
                    h = tl.load(miss_dst + at, mask=used, other=0)
                    k = tl.load(miss_src + at, mask=used, other=0)
                    r = tl.load(slot_of + h, mask=used, other=0)
                    _fetch_rows(
                        r, h, k, used, i < 0, hot_u8, hot_f32, hot_bf16, host_u8, host_f32,
                        host_bf16, out, ROW_U8, ROW_F32, ROW_BF16, SCALE0, ROPE0, ROPE, TILES,
                        TILE, OUT_W, True,
                    )  # fmt: skip
        else:
            r = (pid - T) * BLOCK + tl.arange(0, BLOCK)
            _gather_rows(
                hot_u8, hot_f32, hot_bf16, ids, out, r, r < n, pending, ROW_U8, ROW_F32,
                ROW_BF16, SCALE0, ROPE0, TILES * TILE, ROPE, TILE, OUT_W, 1,
            )  # fmt: skip

    @triton.jit
    def _stage_misses(
        pending, miss_src, miss_dst, miss_count, slot_of, ids, K,
        BLOCK: tl.constexpr, CLEAR: tl.constexpr, SLOTS: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        used = j < tl.load(miss_count + b)
        at = b.to(tl.int64) * K + j
        dst = tl.load(miss_dst + at, mask=used, other=0)
        if CLEAR:
            tl.store(pending + dst, -1, mask=used)
        else:
            tl.store(pending + dst, tl.load(miss_src + at, mask=used, other=0), mask=used)
        if SLOTS:  # each selected row's place in the read's output
            ok = j < K
            tl.store(slot_of + tl.load(ids + at, mask=ok, other=0), at.to(tl.int32), mask=ok)

    @triton.jit
    def _copy_misses(
        hot, host, miss_src, miss_dst, miss_count, K,
        WORDS: tl.constexpr, WPAD: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # A few programs per request stride over its misses: a grid sized by the plan's width
        # would be mostly empty programs (a step misses ~5 % of the top-k).
        b = tl.program_id(0)
        count = tl.load(miss_count + b)
        w = tl.arange(0, WPAD)
        for j0 in range(tl.program_id(1) * BLOCK, count, tl.num_programs(1) * BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            used = j < count
            at = b.to(tl.int64) * K + j
            src = tl.load(miss_src + at, mask=used, other=0).to(tl.int64)
            dst = tl.load(miss_dst + at, mask=used, other=0).to(tl.int64)
            m = used[:, None] & (w[None, :] < WORDS)
            v = tl.load(host + src[:, None] * WORDS + w[None, :], mask=m)
            tl.store(hot + dst[:, None] * WORDS + w[None, :], v, mask=m)


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
    part: str = "all",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gather_decode(hot, ids)``, except that a row ``h`` with ``pending[h] = key >= 0`` is
    read from ``host[key]`` (pinned, uint8 [N, 656]) and its bytes written to ``hot[h]``.
    ``part="misses"`` decodes only those rows, into ``out`` (bf16 [*ids.shape, 576]), whose
    other rows ``gather_decode(hot, ids, pending=pending, part="hits", out=out)`` fills.
    ``block`` rows per program, ``warps`` per program: the five shapes of
    benchmarks/results/in_read_h200.json lie within 2 % of each other at batches 64 and 112 on
    an H200 (fresh host rows per launch), where the PCIe fetch of the misses sets the time."""
    check_rows(hot=hot, host=host, pinned=("host",))
    if part not in ("all", "misses"):
        raise ValueError(f"part must be 'all' or 'misses', got {part!r}")
    if (part == "misses") != (out is not None):
        raise ValueError("out is needed for part='misses', and only then")
    flat = ids.reshape(-1).contiguous()
    out = decoded_rows(ids, out, hot.device)
    n = flat.numel()
    hv = [_HostRows(host, d) for d in (torch.uint8, torch.float32, torch.bfloat16)]
    _read_host_misses[(triton.cdiv(n, block),)](
        hot, hot.view(torch.float32), hot.view(torch.bfloat16), *hv, pending, flat, out, n,
        ROW_BYTES, ROW_BYTES // 4, ROW_BYTES // 2, SCALE_AT, ROPE_AT, ROPE_DIM,
        LATENT_DIM // FP8_TILE, FP8_TILE, KV_DIM, block, part == "misses", num_warps=warps,
    )  # fmt: skip
    return out


def read_rows_apart(
    hot: torch.Tensor,
    host: torch.Tensor,
    pending: torch.Tensor,
    ids: torch.Tensor,
    plan: tuple,
    slot_of: torch.Tensor,
    *,
    miss_programs: int = 64,
    chunk: int = 16,
    block: int = 16,
    warps: int = 4,
) -> torch.Tensor:
    """``read_rows_from_host(hot, host, pending, ids)`` (the same bytes, the same output) in one
    launch whose programs take one role each: ``miss_programs`` of them walk the miss ``plan``
    (miss_src, miss_dst, miss_count) ``chunk`` misses at a time, each row read from the host
    pool into its hot row and its output row ``slot_of[hot row]``; the others read only hot rows,
    ``block`` per program, as ``gather_decode(part="hits")``. ``pending`` and ``slot_of`` as
    ``stage_misses(..., slot_of=, ids=)`` leaves them; ``ids``: [B, K]."""
    check_rows(hot=hot, host=host, pinned=("host",))
    if ids.dim() != 2:
        raise ValueError(f"ids must be [batch, top_k], got shape {list(ids.shape)}")
    for what, v in (("miss_programs", miss_programs), ("chunk", chunk), ("block", block)):
        if v < 1:
            raise ValueError(f"{what} must be >= 1, got {v}")
    B, K = ids.shape
    flat = ids.reshape(-1).contiguous()
    out = decoded_rows(ids, None, hot.device)
    if flat.numel() == 0:
        return out
    miss_src, miss_dst, miss_count = plan
    grid = miss_programs + triton.cdiv(flat.numel(), block)
    hv = [_HostRows(host, d) for d in (torch.uint8, torch.float32, torch.bfloat16)]
    _read_apart[(grid,)](
        hot, hot.view(torch.float32), hot.view(torch.bfloat16), *hv, pending, flat, out,
        flat.numel(), miss_src, miss_dst, miss_count, slot_of, B, miss_dst.shape[1],
        miss_programs, ROW_BYTES, ROW_BYTES // 4, ROW_BYTES // 2, SCALE_AT, ROPE_AT, ROPE_DIM,
        LATENT_DIM // FP8_TILE, FP8_TILE, KV_DIM, block, chunk, num_warps=warps,
    )  # fmt: skip
    return out


def stage_misses(
    pending: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    *,
    clear: bool = False,
    slot_of: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
) -> None:
    """``pending[miss_dst[b, j]] = miss_src[b, j]`` for ``j < miss_count[b]``: the resolve op's
    miss plan (int32 [B, K], [B, K], [B]) as the reads take it, in one launch. ``clear``: set
    those entries back to -1 once the rows were read (the next layer's plan starts empty).
    ``slot_of`` (int32, one entry per hot row) with ``ids`` (int32 [B, K], the read's rows):
    also ``slot_of[ids[b, j]] = b * K + j``, each row's place in the read's output."""
    for what, t in (("miss_src", miss_src), ("miss_dst", miss_dst), ("miss_count", miss_count)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous int32, got {t.dtype}")
    if pending.dtype != torch.int32:
        raise ValueError(f"pending must be int32, got {pending.dtype}")
    if (slot_of is None) != (ids is None):
        raise ValueError("slot_of and ids come together")
    B, K = miss_dst.shape
    if ids is not None and (ids.dtype != torch.int32 or tuple(ids.shape) != (B, K)):
        raise ValueError(f"ids must be int32 [{B}, {K}], got {ids.dtype} {list(ids.shape)}")
    if B == 0:
        return
    block = 1024
    slots = slot_of is not None
    _stage_misses[(B, triton.cdiv(K, block))](
        pending, miss_src, miss_dst, miss_count, slot_of if slots else pending,
        ids.contiguous() if slots else miss_dst, K, block, clear, slots, num_warps=4,
    )  # fmt: skip


def copy_misses(
    host: torch.Tensor,
    hot: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    *,
    block: int = 32,
    programs: int = 4,
    warps: int = 4,
) -> None:
    """``hot[miss_dst[b, j]] = host[miss_src[b, j]]`` for ``j < miss_count[b]``: the resolve
    op's plan copied over PCIe by SM loads from the pinned pool (uint8 [N, 656] both), meant to
    run on a side stream while ``gather_decode(part="hits")`` reads the rows already hot;
    ``programs`` per request, each ``block`` rows at a time. The arguments come in the op's
    gather order (host, hot, plan), so ``HiSparseRuntime.gather(copy=copy_misses)`` takes it."""
    check_rows(hot=hot, host=host, pinned=("host",))
    B, K = miss_dst.shape
    if B == 0:
        return
    words = ROW_BYTES // 4
    _copy_misses[(B, programs)](
        hot.view(torch.int32), _HostRows(host, torch.int32), miss_src, miss_dst, miss_count, K,
        words, triton.next_power_of_2(words), block, num_warps=warps,
    )  # fmt: skip
