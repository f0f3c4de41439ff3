"""One DSA engine run of a scenario's workload, recorded for a bit-exact comparison.

The checkpoint is a tiny seeded one (``write_random_checkpoint``, the scenario's arch, layers,
top-k and index groups), written once per (workload, seed) into the run's scratch directory;
the prompts are seeded random byte tokens. A run goes through ``generate`` as any caller's
does, eagerly (no CUDA graphs: the recorder sees every step), inside the engine's two test
seams: ``model.observe`` (each layer's attention output, the final hidden states) and, for a
negative control, ``stores.inject_faults``.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from evals.parity.scenarios import Workload
from hisparse.engine.dsa.generate import generate
from hisparse.engine.dsa.model import observe
from hisparse.engine.dsa.stores import inject_faults
from hisparse.models.dsa.random_checkpoint import write_random_checkpoint
from hisparse.models.dsa.weights import Checkpoint, load_checkpoint


@dataclass
class Run:
    mode: str
    tokens: List[List[int]]
    # layer -> every step's token rows of its attention output, float32 [tokens, hidden], CPU
    attention: Optional[Dict[int, torch.Tensor]] = None
    final_hidden: Optional[torch.Tensor] = None  # every step's sampled tokens [rows, hidden]
    counters: dict = field(default_factory=dict)  # the store's: connector and hybrid moves
    # the store's device row buffers (generate's budget.held: resident rows, or the buffers
    # registered with the connector: hot buffers, hybrid's pages); index keys not counted
    device_kv_bytes: int = 0
    seconds: float = 0.0


class _Recorder:
    """The ``observe`` observer: copies to the CPU in step order."""

    def __init__(self) -> None:
        self.layers: Dict[int, List[torch.Tensor]] = {}
        self.hidden: List[torch.Tensor] = []

    def layer(self, i: int, out: torch.Tensor) -> None:
        self.layers.setdefault(i, []).append(out.detach().to("cpu", torch.float32, copy=True))

    def final(self, hidden: torch.Tensor) -> None:
        self.hidden.append(hidden.detach().to("cpu", torch.float32, copy=True))


def prompts(w: Workload, seed: int, vocab: int) -> List[List[int]]:
    """``w.requests`` seeded random prompts of byte tokens, request i's length in
    [(1 - jitter) x prompt_len, prompt_len]."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = []
    for _ in range(w.requests):
        cut = int(torch.randint(0, int(w.jitter * w.prompt_len) + 1, (1,), generator=g))
        out.append(torch.randint(0, min(vocab, 256), (w.prompt_len - cut,), generator=g).tolist())
    return out


class Checkpoints:
    """Tiny checkpoints of the run, each written once under a scratch directory."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._dir = tempfile.TemporaryDirectory(prefix="hisparse-parity-")
        self._loaded: Dict[tuple, Checkpoint] = {}
        self._written = 0

    def get(self, w: Workload, seed: int) -> Checkpoint:
        ov = w.checkpoint_overrides()
        key = (w.arch, repr(sorted(ov.items())), seed)
        if key not in self._loaded:
            self._loaded.clear()  # a scenario's runs are consecutive: keep one in memory
            d = Path(self._dir.name) / f"{w.arch}-{self._written}"
            self._written += 1
            write_random_checkpoint(d, w.arch, seed=seed, **ov)
            self._loaded[key] = load_checkpoint(d, self.device)
        return self._loaded[key]

    def close(self) -> None:
        self._loaded.clear()
        self._dir.cleanup()


def run(
    cks: Checkpoints,
    w: Workload,
    seed: int,
    mode: str,
    *,
    record: bool = True,
    binding_fault: Optional[str] = None,
    spill_fault: Optional[str] = None,
) -> Run:
    """``w`` in ``mode`` ("resident", "hisparse", "hybrid": under ``w.device_blocks``)."""
    ck = cks.get(w, seed)
    ps = prompts(w, seed, ck.spec.vocab_size)
    rec = _Recorder()
    seams = contextlib.ExitStack()
    with seams:
        if record:
            seams.enter_context(observe(rec))
        if binding_fault or spill_fault:
            seams.enter_context(inject_faults(binding=binding_fault, spill=spill_fault))
        t = time.monotonic()
        g = generate(
            ck, mode, w.row_format, cks.device, ps, w.max_new, w.hot_size,
            max_batch=w.max_batch, graphs=False,
            device_blocks=w.device_blocks if mode == "hybrid" else None,
        )  # fmt: skip
    out = Run(mode, g.tokens, counters=dict(g.counters), seconds=time.monotonic() - t)
    out.device_kv_bytes = int(g.device_bytes.get("rows", 0))
    if record:
        out.attention = {i: torch.cat(v) for i, v in sorted(rec.layers.items())}
        out.final_hidden = torch.cat(rec.hidden) if rec.hidden else None
    return out
