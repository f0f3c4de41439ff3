"""How a HiSparse part's misses reach attention's row read in the GPU-bound step, besides the
resolve op's own gather: Triton kernels over the op's miss plan (miss_src, miss_dst, miss_count).

* ``stage_misses`` writes the plan into a ``pending`` table (``pending[hot row]`` = its host key)
  in one launch, and with ``clear=True`` empties those entries again after the read. (A read
  that retired its own entries would need every warp's load of the entry to come before the
  retirement, and Triton may give several warps their own copy of one row's load; an H200 run
  of that form lost parity. A launch of its own needs no such ordering.)
* ``read_rows_from_host`` ("in-read"): attention's row read itself reads a pending row from the
  pinned host pool over PCIe, beside the hits read from HBM, and writes it to its hot row.
* ``copy_misses`` ("beside"): the plan copied host -> hot rows by SM loads from a few programs
  on a side stream while ``kernels.gather_decode(part="hits")`` decodes the rows already hot;
  after the copy, ``part="misses"`` decodes the rest. Spread over most SMs (4 programs per
  request) such a copy slowed the read beside it as much as it hid (overlap at most 0.13 on an
  H200); from 16 programs it overlaps the read 0.79-0.88 at batch 64 and 0.49-0.66 at 112
  (benchmarks/results/pcie_overlap_h200.md).

Each gives bytes identical to the op's gather, and the row read decodes them as ``gather_decode``
does, so every path stays bit-identical to resident.
"""

from __future__ import annotations

import torch

from hisparse.engine.graph.kernels import ROPE_AT, ROW_BYTES, SCALE_AT, check_rows, triton
from hisparse.models.rows import FP8_TILE, KV_DIM, LATENT_DIM, ROPE_DIM

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _load_rows(u8, f32, bf16, row, m, ROW_U8: tl.constexpr, ROW_F32: tl.constexpr,
                   ROW_BF16: tl.constexpr, SCALE0: tl.constexpr, ROPE0: tl.constexpr,
                   ROPE: tl.constexpr, TILES: tl.constexpr, TILE: tl.constexpr):  # fmt: skip
        """Rows ``row`` [R] (int64) where ``m``: the FP8 latent [R, TILES, TILE] uint8, its
        scales [R, TILES] float32 and the rope [R, ROPE] bf16 (zeros elsewhere)."""
        t = tl.arange(0, TILES)
        lat = t[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :]
        e = tl.arange(0, ROPE)
        q = tl.load(u8 + row[:, None, None] * ROW_U8 + lat, mask=m[:, None, None], other=0)
        s = tl.load(f32 + row[:, None] * ROW_F32 + SCALE0 + t[None, :], mask=m[:, None],
                    other=0.0)  # fmt: skip
        rope = tl.load(bf16 + row[:, None] * ROW_BF16 + ROPE0 + e[None, :], mask=m[:, None],
                       other=0.0)  # fmt: skip
        return q, s, rope

    @triton.jit
    def _store_rows(u8, f32, bf16, row, m, q, s, rope, ROW_U8: tl.constexpr,
                    ROW_F32: tl.constexpr, ROW_BF16: tl.constexpr, SCALE0: tl.constexpr,
                    ROPE0: tl.constexpr, ROPE: tl.constexpr, TILES: tl.constexpr,
                    TILE: tl.constexpr):  # fmt: skip
        t = tl.arange(0, TILES)
        lat = t[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :]
        e = tl.arange(0, ROPE)
        tl.store(u8 + row[:, None, None] * ROW_U8 + lat, q, mask=m[:, None, None])
        tl.store(f32 + row[:, None] * ROW_F32 + SCALE0 + t[None, :], s, mask=m[:, None])
        tl.store(bf16 + row[:, None] * ROW_BF16 + ROPE0 + e[None, :], rope, mask=m[:, None])

    @triton.jit
    def _decode_into(out, r, m, q, s, rope, ROPE: tl.constexpr, TILES: tl.constexpr,
                     TILE: tl.constexpr, OUT_W: tl.constexpr):  # fmt: skip
        """out[r] = the rows decoded as ``gather_decode`` does (exact fp8 -> float, the scale
        rounded to bf16, one float product rounded to bf16; the rope as is), where ``m``."""
        t = tl.arange(0, TILES)
        lat = t[None, :, None] * TILE + tl.arange(0, TILE)[None, None, :]
        e = tl.arange(0, ROPE)
        qf = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        sf = s.to(tl.bfloat16).to(tl.float32)[:, :, None]
        dst = out + r.to(tl.int64)[:, None] * OUT_W
        tl.store(dst[:, :, None] + lat, (qf * sf).to(tl.bfloat16), mask=m[:, None, None])
        tl.store(dst + TILES * TILE + e[None, :], rope, mask=m[:, None])

    @triton.jit
    def _read_rows(
        hot_u8, hot_f32, hot_bf16, host_u8, host_f32, host_bf16, pending, ids, out, n,
        where, miss_src, miss_dst, miss_count, B, K, hot_i32, host_i32,
        ROW_U8: tl.constexpr, ROW_F32: tl.constexpr, ROW_BF16: tl.constexpr,
        SCALE0: tl.constexpr, ROPE0: tl.constexpr, ROPE: tl.constexpr, TILES: tl.constexpr,
        TILE: tl.constexpr, OUT_W: tl.constexpr, BLOCK: tl.constexpr,
        MISS_PROGRAMS: tl.constexpr, MISS_BLOCK: tl.constexpr, WORDS: tl.constexpr,
        WPAD: tl.constexpr, HITS: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        if pid < MISS_PROGRAMS:
            # The misses, by the plan: request b's by program b % MISS_PROGRAMS. The lowest
            # program ids start first and hold a few SMs for the whole read; the PCIe fetch
            # runs there while the other programs read the hits from HBM.
            for b in range(pid, B, MISS_PROGRAMS):
                count = tl.load(miss_count + b)
                for j0 in range(0, count, MISS_BLOCK):
                    j = j0 + tl.arange(0, MISS_BLOCK)
                    m = j < count
                    at = j.to(tl.int64) + b * K  # b * K < B * K, the plan's size
                    k = tl.load(miss_src + at, mask=m, other=0).to(tl.int64)
                    h = tl.load(miss_dst + at, mask=m, other=0).to(tl.int64)
                    r = tl.load(where + h, mask=m, other=0)
                    if WORDS > 0:
                        # The row as whole words into its hot row (the copy's wide loads),
                        # then read back from there (L2) to decode: after the barrier the
                        # program's own stores are visible to all its threads.
                        w = tl.arange(0, WPAD)
                        mw = m[:, None] & (w[None, :] < WORDS)
                        v = tl.load(host_i32 + k[:, None] * WORDS + w[None, :], mask=mw)
                        tl.store(hot_i32 + h[:, None] * WORDS + w[None, :], v, mask=mw)
                        tl.debug_barrier()
                        q, s, rope = _load_rows(
                            hot_u8, hot_f32, hot_bf16, h, m, ROW_U8, ROW_F32, ROW_BF16, SCALE0,
                            ROPE0, ROPE, TILES, TILE,
                        )  # fmt: skip
                    else:
                        q, s, rope = _load_rows(
                            host_u8, host_f32, host_bf16, k, m, ROW_U8, ROW_F32, ROW_BF16,
                            SCALE0, ROPE0, ROPE, TILES, TILE,
                        )  # fmt: skip
                        _store_rows(
                            hot_u8, hot_f32, hot_bf16, h, m, q, s, rope, ROW_U8, ROW_F32,
                            ROW_BF16, SCALE0, ROPE0, ROPE, TILES, TILE,
                        )  # fmt: skip
                    _decode_into(out, r, m, q, s, rope, ROPE, TILES, TILE, OUT_W)
        elif HITS:
            r = (pid - MISS_PROGRAMS) * BLOCK + tl.arange(0, BLOCK)
            ok = r < n
            h = tl.load(ids + r, mask=ok, other=0).to(tl.int64)
            k = tl.load(pending + h, mask=ok, other=-1).to(tl.int64)
            done = ok & (k < 0)
            q, s, rope = _load_rows(
                hot_u8, hot_f32, hot_bf16, h, done, ROW_U8, ROW_F32, ROW_BF16, SCALE0, ROPE0,
                ROPE, TILES, TILE
            )  # fmt: skip
            if MISS_PROGRAMS == 0:  # each program reads its own misses from the host pool
                miss = ok & (k >= 0)
                k = tl.where(miss, k, 0)
                mq, ms, mr = _load_rows(
                    host_u8, host_f32, host_bf16, k, miss, ROW_U8, ROW_F32, ROW_BF16, SCALE0,
                    ROPE0, ROPE, TILES, TILE
                )  # fmt: skip
                # The missed rows' bytes into their hot rows: later steps hit them there.
                _store_rows(
                    hot_u8, hot_f32, hot_bf16, h, miss, mq, ms, mr, ROW_U8, ROW_F32, ROW_BF16,
                    SCALE0, ROPE0, ROPE, TILES, TILE
                )  # fmt: skip
                q = tl.where(miss[:, None, None], mq, q)
                s = tl.where(miss[:, None], ms, s)
                rope = tl.where(miss[:, None], mr, rope)
                done = ok
            _decode_into(out, r, done, q, s, rope, ROPE, TILES, TILE, OUT_W)

    @triton.jit
    def _stage_misses(
        pending, miss_src, miss_dst, miss_count, moved, ids, where, K,
        BLOCK: tl.constexpr, CLEAR: tl.constexpr, COUNT: tl.constexpr, ROW: tl.constexpr,
        WHERE: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        count = tl.load(miss_count + b)
        used = j < count
        if COUNT:
            if tl.program_id(1) == 0:
                tl.atomic_add(moved, count.to(tl.int64) * ROW)
        at = b.to(tl.int64) * K + j
        dst = tl.load(miss_dst + at, mask=used, other=0)
        if CLEAR:
            tl.store(pending + dst, -1, mask=used)
        else:
            tl.store(pending + dst, tl.load(miss_src + at, mask=used, other=0), mask=used)
        if WHERE:  # where[hot row] = its place in ids, for the programs that read the misses
            j_ok = j < K
            tl.store(where + tl.load(ids + at, mask=j_ok, other=0), at.to(tl.int32), mask=j_ok)

    @triton.jit
    def _copy_misses(
        hot, host, miss_src, miss_dst, miss_count, B, K,
        WORDS: tl.constexpr, WPAD: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # A few programs, each with BLOCK rows in flight, stride over the requests: PCIe needs
        # only ~120 KB in flight, and a copy spread over most SMs slows the row read beside it.
        w = tl.arange(0, WPAD)
        for b in range(tl.program_id(0), B, tl.num_programs(0)):
            count = tl.load(miss_count + b)
            for j0 in range(0, count, BLOCK):
                j = j0 + tl.arange(0, BLOCK)
                used = j < count
                at = j.to(tl.int64) + b * K  # b * K < B * K, the plan's size
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
    plan: tuple | None = None,
    where: torch.Tensor | None = None,
    miss_programs: int = 16,
    miss_block: int = 32,
    block: int = 16,
    warps: int = 4,
    words: bool = False,
    part: str = "all",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gather_decode(hot, ids)``, except that a row ``h`` with ``pending[h] = key >= 0`` is
    read from ``host[key]`` (pinned, uint8 [N, 656]) and its bytes written to ``hot[h]``.

    ``miss_programs`` > 0: that many programs of the launch read every miss, by the resolve op's
    ``plan`` (miss_src, miss_dst, miss_count) ``miss_block`` rows at a time, each writing its
    decoded row to ``out[where[h]]`` (``stage_misses(..., ids=ids, where=where)`` wrote
    ``where``); the other programs read the hits, ``block`` rows each. The PCIe fetch then holds
    a few SMs while the rest read HBM, instead of every program waiting on its own misses. The
    rows of ``ids`` must be distinct (a top-k's are): a duplicate would be written only once.
    ``miss_programs=0``: each program reads its own rows, hits and misses, ``block`` at a time.
    ``warps`` per program. ``words``: the miss programs copy a row as 164 words, then decode it
    from its hot row. ``part="misses"``: only the miss programs, into ``out`` (beside a
    ``gather_decode(part="hits")`` on another stream)."""
    check_rows(hot=hot, host=host, pinned=("host",))
    if miss_programs < 0:
        raise ValueError(f"miss_programs must be >= 0, got {miss_programs}")
    for what, v in (("block", block), ("miss_block", miss_block), ("warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{what} must be a power of two >= 1, got {v}")
    flat = ids.reshape(-1).contiguous()
    if out is None:
        out = torch.empty(*ids.shape, KV_DIM, dtype=torch.bfloat16, device=hot.device)
    n = flat.numel()
    if part not in ("all", "misses") or (part == "misses" and not miss_programs):
        raise ValueError(f"part must be 'all', or 'misses' with miss_programs > 0; got {part!r}")
    if miss_programs:
        if plan is None or where is None:
            raise ValueError("miss_programs > 0 needs the plan and the where table")
        miss_src, miss_dst, miss_count = plan
        B, K = miss_dst.shape
        if ids.shape != (B, K) or where.dtype != torch.int32:
            raise ValueError(f"ids must be the plan's [{B}, {K}] and where int32")
    else:  # unused
        miss_src = miss_dst = miss_count = where = pending
        B = K = 0
    hv = [_HostRows(host, d) for d in (torch.uint8, torch.float32, torch.bfloat16)]
    hits = part == "all"
    w = ROW_BYTES // 4
    _read_rows[(miss_programs + (triton.cdiv(n, block) if hits else 0),)](
        hot, hot.view(torch.float32), hot.view(torch.bfloat16), *hv, pending, flat, out, n,
        where, miss_src, miss_dst, miss_count, B, K, hot.view(torch.int32),
        _HostRows(host, torch.int32), ROW_BYTES, ROW_BYTES // 4, ROW_BYTES // 2, SCALE_AT,
        ROPE_AT, ROPE_DIM, LATENT_DIM // FP8_TILE, FP8_TILE, KV_DIM, block, miss_programs,
        miss_block, w if words else 0, triton.next_power_of_2(w), hits, num_warps=warps,
    )  # fmt: skip
    return out


def stage_misses(
    pending: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    *,
    clear: bool = False,
    moved: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    where: torch.Tensor | None = None,
) -> None:
    """``pending[miss_dst[b, j]] = miss_src[b, j]`` for ``j < miss_count[b]``: the resolve op's
    miss plan (int32 [B, K], [B, K], [B]) as the reads take it, in one launch. ``clear``: set
    those entries back to -1 once the rows were read (the next layer's plan starts empty).
    ``moved`` (with ``clear``): the index group's uint64 [1] byte counter, to which the clearing
    launch adds the plan's rows x 656, as the op's gather counts the rows it copies (the in-read
    moves them inside the row read, with no gather of its own).
    ``ids`` [B, K] (the rows the read takes) and ``where`` (int32, one entry per hot row), not
    with ``clear``: also ``where[ids[b, j]] = b * K + j``, the row's place in the read."""
    for what, t in (("miss_src", miss_src), ("miss_dst", miss_dst), ("miss_count", miss_count)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous int32, got {t.dtype}")
    if pending.dtype != torch.int32:
        raise ValueError(f"pending must be int32, got {pending.dtype}")
    if moved is not None and (not clear or moved.dtype != torch.uint64 or moved.numel() != 1):
        raise ValueError("moved must be a uint64 [1] counter, given only with clear=True")
    B, K = miss_dst.shape
    if (ids is None) != (where is None) or (ids is not None and clear):
        raise ValueError("ids and where go together, and not with clear=True")
    if ids is not None and (ids.shape != (B, K) or ids.dtype != torch.int32):
        raise ValueError(f"ids must be int32 [{B}, {K}], got {ids.dtype} {tuple(ids.shape)}")
    if where is not None and where.dtype != torch.int32:
        raise ValueError(f"where must be int32, got {where.dtype}")
    if B == 0:
        return
    block = 1024
    # The counter's bits as int64: exact below 2**63 bytes.
    counter = miss_count if moved is None else moved.view(torch.int64)
    _stage_misses[(B, triton.cdiv(K, block))](
        pending, miss_src, miss_dst, miss_count, counter,
        miss_dst if ids is None else ids.contiguous(), pending if where is None else where, K,
        block, clear, moved is not None, ROW_BYTES, where is not None, num_warps=4,
    )  # fmt: skip


def copy_misses(
    host: torch.Tensor,
    hot: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    *,
    programs: int = 16,
    block: int = 64,
    warps: int = 16,
) -> None:
    """``hot[miss_dst[b, j]] = host[miss_src[b, j]]`` for ``j < miss_count[b]``: the resolve
    op's plan copied over PCIe by SM loads from the pinned pool (uint8 [N, 656] both), meant to
    run on a side stream while ``gather_decode(part="hits")`` reads the rows already hot.
    ``programs`` programs in all (so a few SMs), each taking requests ``p, p + programs, ...``
    ``block`` rows at a time with ``warps`` warps. The arguments come in the op's gather order
    (host, hot, plan), so ``HiSparseRuntime.gather(copy=copy_misses)`` takes it."""
    check_rows(hot=hot, host=host, pinned=("host",))
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    for what, v in (("block", block), ("warps", warps)):  # Triton's tile and warp counts
        if v < 1 or v & (v - 1):
            raise ValueError(f"{what} must be a power of two >= 1, got {v}")
    B, K = miss_dst.shape
    if B == 0:
        return
    words = ROW_BYTES // 4
    _copy_misses[(programs,)](
        hot.view(torch.int32), _HostRows(host, torch.int32), miss_src, miss_dst, miss_count, B, K,
        words, triton.next_power_of_2(words), block, num_warps=warps,
    )  # fmt: skip
