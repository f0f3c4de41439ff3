"""Continuous batching: admit waiting requests while state rows are free, run one step (every
running request decodes one token, the admitted ones prefill), retire the finished, until all are
done. Admission depends only on how many state rows are free, so every mode runs the same
batches; which row a request gets is the KV store's business (``KVStore.begin_step``)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from hisparse.engine.requests import Request


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _DecodeClock:
    """Times the steps without a prefill apart; syncs the device only where a run of them
    starts or ends, so decode steps are never serialised by the measurement."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.started, self.wall, self.tokens = dev, None, 0.0, 0

    def before_step(self, has_prefill: bool, num_decode: int) -> None:
        if not has_prefill and self.started is None:
            sync(self.dev)
            self.started = time.perf_counter()
        elif has_prefill and self.started is not None:
            sync(self.dev)
            self.wall += time.perf_counter() - self.started
            self.started = None
        if not has_prefill:
            self.tokens += num_decode

    def stop(self) -> None:
        if self.started is not None:
            self.wall += time.perf_counter() - self.started


@dataclass
class LoopTotals:
    tokens_done: int = 0
    steps: int = 0
    peak_running: int = 0
    peak_host_rows: int = 0  # most KV rows held by running requests at once (per layer)
    wall_s: float = 0.0
    decode_tokens: int = 0
    decode_wall_s: float = 0.0


def run_steps(
    eng,
    reqs: List[Request],
    out_tokens: torch.Tensor,
    final_hidden: torch.Tensor,
    progress: Optional[Callable[[int], None]],
) -> LoopTotals:
    """Every request to completion; closes the engine's KV store whatever happens."""
    dev, tot = eng.device, LoopTotals()
    waiting, running = deque(reqs), []
    num_rows = eng.cfg.num_state_rows
    finished_ids: List[str] = []
    clock = _DecodeClock(dev)
    sync(dev)
    t0 = time.perf_counter()
    try:
        while waiting or running:
            new = []
            while waiting and len(running) + len(new) < num_rows:
                new.append(waiting.popleft())
            dec = list(running)
            clock.before_step(bool(new), len(dec))
            eng.kv.begin_step(dec, new, finished_ids)  # gives each new request its state row
            eng.forward(dec, new, out_tokens, final_hidden)
            running = _advance(running, dec, new, tot)
            running, finished_ids = _retire(eng, running)
            eng.kv.end_step()
            tot.steps += 1
            if progress is not None:
                progress(tot.tokens_done)
        sync(dev)
        tot.wall_s = time.perf_counter() - t0
        clock.stop()
    finally:
        eng.kv.close()
    tot.decode_tokens, tot.decode_wall_s = clock.tokens, clock.wall
    return tot


def _advance(
    running: List[Request], dec: List[Request], new: List[Request], tot: LoopTotals
) -> List[Request]:
    for r in dec:
        r.generated += 1
    for r in new:
        r.generated = 1
    running = running + new
    tot.peak_running = max(tot.peak_running, len(running))
    held = sum(r.prompt_len + r.generated - 1 for r in running)
    tot.peak_host_rows = max(tot.peak_host_rows, held)
    tot.tokens_done += len(dec) + len(new)
    return running


def _retire(eng, running: List[Request]):
    """Requests that reached their output length leave; returns (still running, finished ids,
    which the next step's ``begin_step`` reports to the store)."""
    still, finished = [], []
    for r in running:
        if r.generated >= r.output_len:
            eng.kv.finish(r)  # frees its state row
            finished.append(r.rid)
        else:
            still.append(r)
    return still, finished
