"""One engine step's batch: which requests run, at which positions, under which keys, and where
their new rows go in a store's device window. Rows are in batch order: decode requests first
(one row each), then each admitted prompt whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from hisparse.engine.kvstore import StepRows
from hisparse.engine.requests import Request


def to_device(values, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """A small host list -> device tensor; from pinned memory on CUDA, so the copy is
    asynchronous (a pageable copy would synchronise the stream every time)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


@dataclass
class StepBatch:
    decode: List[Request]
    prefill: List[Request]
    slots: Optional[torch.Tensor]  # decode requests' state rows, on the device
    positions: Optional[torch.Tensor]  # decode requests' current positions, on the device
    context_len: int  # longest decode context this step (max position + 1)
    prompt_positions: List[torch.Tensor]  # each prompt's positions 0..P-1, on the device
    keys: torch.Tensor  # every new row's key, batch order, on the device
    keys_cpu: torch.Tensor  # the same on the CPU (the connector's slot mapping)
    window_rows: torch.Tensor  # device-window rows the new rows are written to
    window_src: torch.Tensor  # which new row goes to each of them

    @property
    def num_decode(self) -> int:
        return len(self.decode)

    @property
    def num_prefill(self) -> int:
        return len(self.prefill)

    def rows(self, encoded: torch.Tensor) -> StepRows:
        """This step's encoded rows of one layer, addressed for the store."""
        return StepRows(encoded, self.keys, self.keys_cpu, self.window_rows, self.window_src)

    @classmethod
    def build(
        cls,
        decode: Sequence[Request],
        prefill: Sequence[Request],
        max_context: int,
        window: int,
        device: torch.device,
    ) -> "StepBatch":
        """``window``: the store's device-window rows per request (each request's newest
        ``window`` tokens sit at ``slot * window + pos % window``)."""
        C, dev = max_context, device
        keys_cpu, keys, win_rows, win_src = [], [], [], []
        slots = positions = None
        context_len = 0
        if decode:
            slot_list = [r.slot for r in decode]
            pos_list = [r.pos for r in decode]
            slots = to_device(slot_list, dev)
            positions = to_device(pos_list, dev)
            dkeys = torch.tensor(
                [s * C + p for s, p in zip(slot_list, pos_list)], dtype=torch.int64
            )
            keys_cpu.append(dkeys)
            keys.append(to_device(dkeys.tolist(), dev))
            context_len = max(pos_list) + 1
            win_rows.append(slots * window + positions.remainder(window))
            win_src.append(torch.arange(len(decode), device=dev))
        prompt_positions = []
        first = len(decode)  # batch index of the current prompt's first row
        for r in prefill:
            P = r.prompt_len
            pp = torch.arange(P, dtype=torch.int64)
            prompt_positions.append(pp.to(dev))
            pkeys = r.slot * C + pp
            keys_cpu.append(pkeys)
            keys.append(pkeys.to(dev))
            newest = torch.arange(max(0, P - window), P, dtype=torch.int64)
            win_rows.append((r.slot * window + newest.remainder(window)).to(dev))
            win_src.append((first + newest).to(dev))
            first += P
        return cls(
            list(decode),
            list(prefill),
            slots,
            positions,
            context_len,
            prompt_positions,
            torch.cat(keys),
            torch.cat(keys_cpu),
            torch.cat(win_rows),
            torch.cat(win_src),
        )
