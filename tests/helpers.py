"""Shared builders for op tests: fresh state, output buffers, and running an op step."""

from __future__ import annotations

import torch

from hisparse import ops
from hisparse.runtime import empty_residency

# resolve_residency's tensor arguments in schema order (the error messages name them).
RESOLVE_TENSOR_ARGS = [
    "top_k",
    "state_rows",
    "resident_rows",
    "slot_keys",
    "lru",
    "stats",
    "out_rows",
    "miss_src",
    "miss_dst",
    "miss_count",
]


def new_state(S, H, device="cpu"):
    slot_keys, lru = empty_residency(S, H, device)
    stats = torch.zeros(2, dtype=torch.uint64, device=device)
    return slot_keys, lru, stats


def new_plan(B, K, device="cpu"):
    out = torch.full((B, K), -7, dtype=torch.int32, device=device)
    src = torch.full((B, K), -7, dtype=torch.int32, device=device)
    dst = torch.full((B, K), -7, dtype=torch.int32, device=device)
    count = torch.full((B,), -7, dtype=torch.int32, device=device)
    return out, src, dst, count


def run_resolve(
    top_k, state_rows, slot_keys, lru, stats, *, num_keys, hot_base=0, resident_rows=None
):
    B, K = top_k.shape
    out, src, dst, count = new_plan(B, K, top_k.device)
    ops.resolve_residency(
        top_k,
        state_rows,
        slot_keys,
        lru,
        stats,
        out,
        src,
        dst,
        count,
        num_keys=num_keys,
        hot_base=hot_base,
        resident_rows=resident_rows,
    )
    return out, src, dst, count


def stats_list(stats):
    return [int(x) for x in stats.cpu().tolist()]
