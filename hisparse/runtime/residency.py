"""A batch of state rows' residency state (``slot_keys``, ``lru``): made empty, and emptied in
place."""

from __future__ import annotations

from typing import Union

import torch


def empty_residency(
    num_state_rows: int, hot_size: int, device: Union[str, torch.device] = "cpu"
) -> tuple:
    """``(slot_keys, lru)`` of state rows with nothing hot: slot_keys int32 [S, H] all -1, lru
    int16 [S, H] with every row 0..H-1 (what ``invalidate`` leaves in a row, docs/ops.md)."""
    slot_keys = torch.empty((num_state_rows, hot_size), dtype=torch.int32, device=device)
    lru = torch.empty((num_state_rows, hot_size), dtype=torch.int16, device=device)
    reset_residency(slot_keys, lru)
    return slot_keys, lru


def reset_residency(slot_keys: torch.Tensor, lru: torch.Tensor) -> None:
    """Empty every state row in place: the tensors may already be bound (a captured CUDA graph
    reads them by address)."""
    slot_keys.fill_(-1)
    lru.copy_(torch.arange(lru.shape[-1], dtype=torch.int16, device=lru.device).expand_as(lru))
