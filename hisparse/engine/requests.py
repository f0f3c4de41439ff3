"""The workload: seeded prompts and output lengths, and the per-request state the scheduling
loop advances."""

from __future__ import annotations

from typing import List

import torch

from hisparse.engine.config import EngineConfig, request_lengths


class Request:
    """One request of the workload. ``slot`` is its state row while it runs (-1 before): the
    row of the indexer caches it uses and the base of its keys (``slot * max_context``)."""

    __slots__ = ("idx", "rid", "prompt", "prompt_len", "output_len", "slot", "generated")

    def __init__(self, idx: int, prompt: torch.Tensor, output_len: int) -> None:
        self.idx = idx
        self.rid = f"req-{idx}"
        self.prompt = prompt
        self.prompt_len = int(prompt.numel())
        self.output_len = output_len
        self.slot = -1
        self.generated = 0

    @property
    def pos(self) -> int:
        """Position of the token fed in this decode step (= tokens already in the KV)."""
        return self.prompt_len + self.generated - 1


def make_requests(cfg: EngineConfig) -> List[Request]:
    prompts, outputs = request_lengths(cfg)
    g = torch.Generator().manual_seed(cfg.seed + 7919)
    reqs = []
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        toks = torch.randint(0, cfg.vocab, (p,), generator=g, dtype=torch.int64)
        reqs.append(Request(i, toks, o))
    return reqs
