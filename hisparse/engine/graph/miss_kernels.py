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

from hisparse.models.dsa.kernels.rows import ROPE_AT, ROW_BYTES, SCALE_AT, check_rows, triton
from hisparse.models.rows import FP8_TILE, KV_DIM, LATENT_DIM, ROPE_DIM

if triton is not None:
    import triton.language as tl

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
    def _stage_misses(
        pending, miss_src, miss_dst, miss_count, moved, K,
        BLOCK: tl.constexpr, CLEAR: tl.constexpr, COUNT: tl.constexpr, ROW: tl.constexpr,
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
    block: int = 64,
    warps: int = 8,
) -> torch.Tensor:
    """``gather_decode(hot, ids)``, except that a row ``h`` with ``pending[h] = key >= 0`` is
    read from ``host[key]`` (pinned, uint8 [N, 656]) and its bytes written to ``hot[h]``.
    ``block`` rows per program, ``warps`` per program: on an H200 (fresh host rows per launch)
    the five shapes lay within 4 % of each other at batches 64 and 112 in one run
    (benchmarks/results/in_read_h200.json) and within 1 % at 112 but 16 % at 64 in another
    (in_read_h200_run2.json, 64 x 8 the slowest there); the PCIe fetch of the misses sets the
    time."""
    check_rows(hot=hot, host=host, pinned=("host",))
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
    pending: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    *,
    clear: bool = False,
    moved: torch.Tensor | None = None,
) -> None:
    """``pending[miss_dst[b, j]] = miss_src[b, j]`` for ``j < miss_count[b]``: the resolve op's
    miss plan (int32 [B, K], [B, K], [B]) as the reads take it, in one launch. ``clear``: set
    those entries back to -1 once the rows were read (the next layer's plan starts empty).
    ``moved`` (with ``clear``): the index group's uint64 [1] byte counter, to which the clearing
    launch adds the plan's rows x 656, as the op's gather counts the rows it copies (the in-read
    moves them inside the row read, with no gather of its own)."""
    for what, t in (("miss_src", miss_src), ("miss_dst", miss_dst), ("miss_count", miss_count)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{what} must be contiguous int32, got {t.dtype}")
    if pending.dtype != torch.int32:
        raise ValueError(f"pending must be int32, got {pending.dtype}")
    if moved is not None and (not clear or moved.dtype != torch.uint64 or moved.numel() != 1):
        raise ValueError("moved must be a uint64 [1] counter, given only with clear=True")
    B, K = miss_dst.shape
    if B == 0:
        return
    block = 1024
    # The counter's bits as int64: exact below 2**63 bytes.
    counter = miss_count if moved is None else moved.view(torch.int64)
    _stage_misses[(B, triton.cdiv(K, block))](
        pending, miss_src, miss_dst, miss_count, counter, K, block, clear, moved is not None,
        ROW_BYTES, num_warps=4,
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
