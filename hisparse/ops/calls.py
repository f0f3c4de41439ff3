"""Python entry points of the hisparse ops, and their fake (meta) kernels.

The ops mutate preallocated tensors and return nothing; see docs/ops.md for the contract.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from hisparse.ops import extension as _ext
from hisparse.ops.limits import INT64_MAX, INT64_MIN, as_index


def _device_type(t: torch.Tensor) -> str:
    return "cuda" if t.is_cuda else "cpu"


def _int_arg(op: str, name: str, value) -> int:
    """An integer argument of an op as a plain int; a bool (which torch would pass on as 0 or 1)
    or a float is refused here with the RuntimeError the kernels raise for it. So is an integer
    outside int64: torch cannot hand it to the op and would fail without naming the argument
    (``int too big to convert``). Every int argument of the ops is a count or a row in
    [0, 2^31-1], the range this line gives (as the kernels' for ``num_keys`` does)."""
    v = as_index(f"{op}: argument '{name}'", value, error=RuntimeError)
    if not INT64_MIN <= v <= INT64_MAX:
        raise RuntimeError(f"{op}: argument '{name}' must be in [0, 2^31-1], got {v}")
    return v


def _op(name: str):
    _ext.load()
    if not hasattr(torch.ops.hisparse, name):
        _ext.require("cpu")
    return getattr(torch.ops.hisparse, name)


def bound_op(name: str, device_type: str):
    """The registered op ``name`` (``hisparse_resolve_residency``, ``hisparse_gather``, ...),
    after checking once that a ``device_type`` kernel was built: for a caller that checks its own
    fixed arguments once (the runtime) and calls the op every step without the per-call checks
    of the functions below."""
    _ext.require(device_type)
    return _op(name)


def resolve_residency(
    top_k: torch.Tensor,
    state_rows: torch.Tensor,
    slot_keys: torch.Tensor,
    lru: torch.Tensor,
    stats: torch.Tensor,
    out_rows: torch.Tensor,
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    *,
    num_keys: int,
    hot_base: int = 0,
    resident_rows: Optional[torch.Tensor] = None,
) -> None:
    """Resolve which selected keys are hot, evict LRU slots for the misses, write the miss plan."""
    if isinstance(top_k, torch.Tensor):
        _ext.require(_device_type(top_k))
    op = "hisparse_resolve_residency"
    num_keys = _int_arg(op, "num_keys", num_keys)
    hot_base = _int_arg(op, "hot_base", hot_base)
    _op(op)(
        top_k,
        state_rows,
        resident_rows,
        slot_keys,
        lru,
        stats,
        out_rows,
        miss_src,
        miss_dst,
        miss_count,
        num_keys,
        hot_base,
    )


def gather(
    host: Sequence[torch.Tensor],
    hot: Sequence[torch.Tensor],
    miss_src: torch.Tensor,
    miss_dst: torch.Tensor,
    miss_count: torch.Tensor,
    moved_bytes: Optional[torch.Tensor] = None,
) -> None:
    """Copy each planned miss from every host view into the matching hot view."""
    if isinstance(miss_src, torch.Tensor):
        _ext.require(_device_type(miss_src))
    _op("hisparse_gather")(list(host), list(hot), miss_src, miss_dst, miss_count, moved_bytes)


def invalidate(
    slot_keys: torch.Tensor,
    lru: torch.Tensor,
    state_rows: torch.Tensor,
    keys: Optional[torch.Tensor] = None,
) -> None:
    """Reset whole state rows (keys None) or drop the hot copies of rewritten keys."""
    if isinstance(slot_keys, torch.Tensor):
        _ext.require(_device_type(slot_keys))
    _op("hisparse_invalidate")(slot_keys, lru, state_rows, keys)


def _check_one_device(op: str, ref_name: str, ref: torch.Tensor, named, *, host_views=()) -> None:
    """The contract puts every tensor on one device; the fake kernel is the one place a meta
    tensor among real ones lands (the dispatcher picks Meta over CPU and CUDA), so it must
    refuse the mix instead of silently doing nothing. Host views may also live on the CPU."""
    dev = ref.device
    for name, t in named:
        if t is not None and t.device != dev:
            raise RuntimeError(
                f"{op}: argument '{name}' must be on {dev} like '{ref_name}', got {t.device}"
            )
    for name, t in host_views:
        if t.device != dev and t.device.type != "cpu":
            raise RuntimeError(
                f"{op}: argument '{name}' must be on {dev} like '{ref_name}' or "
                f"in host memory, got {t.device}"
            )


def save_rows(
    src: Sequence[torch.Tensor],
    host: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    host_rows: torch.Tensor,
    moved_bytes: Optional[torch.Tensor] = None,
) -> None:
    """Write a step's new rows to the host pool: for every member layer l and entry i, copy row
    ``src_rows[i]`` of ``src[l]`` into row ``host_rows[i]`` of ``host[l]``, all in one launch.

    ``src[l]`` is where layer l's new rows are (the paged KV cache or the hot buffer, on the
    compute device), ``host[l]`` its host view (pinned host memory for the CUDA backend);
    entries whose source or host row is out of range (e.g. -1 padding) are skipped. Host rows
    must be distinct among the copied entries. See docs/ops.md.
    """
    if isinstance(src_rows, torch.Tensor):
        _ext.require(_device_type(src_rows))
    _op("hisparse_save_rows")(list(src), list(host), src_rows, host_rows, moved_bytes)


def topk_slots(
    scores: torch.Tensor,
    req: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
) -> None:
    """Each token's top-k positions as slots, into ``out`` (int64 [T, k]): among the positions
    of ``scores[t]`` (float32 [T, L]) above -inf, the k highest scores (the lower position first
    among equal ones), in ascending position order, each written as ``block_table[req[t], p //
    block_size] * block_size + p % block_size``; -1 after them. A token whose ``req`` is not a
    row of ``block_table`` gets -1 only. See docs/ops.md."""
    if isinstance(scores, torch.Tensor):
        _ext.require(_device_type(scores))
    size = _int_arg("hisparse_topk_slots", "block_size", block_size)
    _op("hisparse_topk_slots")(scores, req, block_table, size, out)


# The ops only mutate their arguments, so tracing needs nothing but their existence and the
# device check.
def _resolve_fake(
    top_k,
    state_rows,
    resident_rows,
    slot_keys,
    lru,
    stats,
    out_rows,
    miss_src,
    miss_dst,
    miss_count,
    num_keys,
    hot_base,
):
    # No kernel runs on meta tensors: the fake refuses what the kernels' validator refuses.
    _int_arg("hisparse_resolve_residency", "num_keys", num_keys)
    _int_arg("hisparse_resolve_residency", "hot_base", hot_base)
    _check_one_device(
        "hisparse_resolve_residency",
        "top_k",
        top_k,
        (
            ("state_rows", state_rows),
            ("resident_rows", resident_rows),
            ("slot_keys", slot_keys),
            ("lru", lru),
            ("stats", stats),
            ("out_rows", out_rows),
            ("miss_src", miss_src),
            ("miss_dst", miss_dst),
            ("miss_count", miss_count),
        ),
    )
    return None


def _gather_fake(host, hot, miss_src, miss_dst, miss_count, moved_bytes):
    _check_one_device(
        "hisparse_gather",
        "miss_src",
        miss_src,
        [("miss_dst", miss_dst), ("miss_count", miss_count), ("moved_bytes", moved_bytes)]
        + [(f"hot[{i}]", t) for i, t in enumerate(hot)],
        host_views=[(f"host[{i}]", t) for i, t in enumerate(host)],
    )
    return None


def _invalidate_fake(slot_keys, lru, state_rows, keys):
    _check_one_device(
        "hisparse_invalidate",
        "slot_keys",
        slot_keys,
        (("lru", lru), ("state_rows", state_rows), ("keys", keys)),
    )
    return None


def _save_rows_fake(src, host, src_rows, host_rows, moved_bytes):
    _check_one_device(
        "hisparse_save_rows",
        "src_rows",
        src_rows,
        [("host_rows", host_rows), ("moved_bytes", moved_bytes)]
        + [(f"src[{i}]", t) for i, t in enumerate(src)],
        host_views=[(f"host[{i}]", t) for i, t in enumerate(host)],
    )
    return None


def _topk_slots_fake(scores, req, block_table, block_size, out):
    _check_one_device(
        "hisparse_topk_slots",
        "scores",
        scores,
        (("req", req), ("block_table", block_table), ("out", out)),
    )
    return None


def _register_fakes() -> None:
    if _ext.load() is None:
        return
    for name, fake in (
        ("hisparse_resolve_residency", _resolve_fake),
        ("hisparse_gather", _gather_fake),
        ("hisparse_invalidate", _invalidate_fake),
        ("hisparse_save_rows", _save_rows_fake),
        ("hisparse_topk_slots", _topk_slots_fake),
    ):
        torch.library.register_fake(f"hisparse::{name}")(fake)


_register_fakes()
