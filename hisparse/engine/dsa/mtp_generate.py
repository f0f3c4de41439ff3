"""Greedy MTP speculative decoding (one draft token per step) in either mode, batched like
``generate``: each step verifies every running request's pending token and its draft in one
target forward and admits at most one waiting prompt, then one draft forward runs the MTP layer
over the positions that step confirmed.

Verification: the target runs ``[t, d]`` at positions ``L, L + 1``; its greedy token after
``t`` decides. Equal to ``d``: both are kept and the token after ``d`` comes free. Otherwise the
target's token replaces ``d`` and the row written at ``L + 1`` (for ``d``) is rejected: it is
discarded (``mtp.discard``: its HiSparse hot copies dropped) and the next step writes position
``L + 1`` again before its layers read. The MTP layer only ever runs on confirmed tokens, so its
rows are never rejected. Output is the plain greedy output; only the number of target forwards
changes.

A verify step's ``[t, d]`` is a decode of two query tokens (``model.Decodes``, q = 2), as in the
vLLM classes: in HiSparse mode each index group resolves one row per running request, the union
of its tokens' top-k, into its hot buffer (``hisparse.models.dsa.union``), and each token reads
its own slice; only an admitted prompt reads rows back from the host pool. The draft pass does
the same for the one or two positions each running request confirmed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from hisparse.engine.dsa.generate import (
    Generation,
    _context,
    check_options,
    new_generation,
    open_run,
)
from hisparse.engine.dsa.model import Decodes
from hisparse.engine.dsa.mtp import MTPHead, MTPModel, discard
from hisparse.engine.dsa.stores import upload
from hisparse.models.dsa.weights import Checkpoint

# The connector's scheduler counts every token scheduled to a request (it has no rollback
# without vLLM's block lists), and here the draft pass schedules each confirmed position a
# second time and a rejected position is scheduled twice by the target: the pool and the key
# stride are sized for that (a request schedules under 4x its context).
_SCHEDULED_PER_POSITION = 4
# Query tokens of a decode: the pending token and one draft.
_Q = 2


@dataclass
class SpecGeneration(Generation):
    proposed: int = 0  # draft tokens verified
    accepted: int = 0  # of which the target agreed
    target_steps: int = 0  # target forwards
    rejected_keys: List[int] = field(default_factory=list)  # keys discarded, in order

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def generate_mtp(
    ck: Checkpoint,
    head: MTPHead,
    mode: str,
    row_format: str,
    device: torch.device,
    prompts: Sequence[Sequence[int]],
    max_new: int,
    hot_size: Optional[int] = None,
    *,
    max_batch: Optional[int] = None,
    key_format: Optional[str] = None,
    backend: str = "auto",
    store_wrapper=None,
) -> SpecGeneration:
    """Greedy tokens of every prompt by MTP speculation; ``ck`` / ``head`` from
    ``mtp.load_mtp``. ``store_wrapper(store)``: a test wraps the store (e.g. to check reads)."""
    check_options(row_format, mode, ck.cfg)
    ctx = _context(prompts, max_new + 1)
    if mode == "hisparse":
        ctx *= _SCHEDULED_PER_POSITION
    nmax = max(1, min(max_batch or len(prompts), len(prompts)))
    store, fwd = open_run(
        ck, mode, row_format, device, ctx, nmax, hot_size, key_format, backend, q=_Q
    )
    out = new_generation(SpecGeneration(mode), len(prompts))
    t0 = time.perf_counter()
    inner = store
    if store_wrapper is not None:
        store = store_wrapper(store)
    try:
        _Loop(MTPModel(fwd, head), store, prompts, max_new, nmax, out).run()
    finally:
        out.counters = inner.close()
    out.seconds = time.perf_counter() - t0
    return out


class _Loop:
    def __init__(self, model: MTPModel, store, prompts, max_new: int, nmax: int, out) -> None:
        self.m, self.store, self.prompts = model, store, prompts
        self.max_new, self.nmax, self.out = max_new, nmax, out
        self.dev = model.fwd.device
        self.length: Dict[int, int] = {}  # request -> positions whose target rows are confirmed
        self.draft: Dict[int, Optional[int]] = {}  # request -> its draft token (None: none)

    def _decodes(self, counts, nrun: int) -> Decodes:
        """The leading ``nrun`` rows (one or two tokens each) as decodes of up to two tokens."""
        at = [b * _Q + j for b in range(nrun) for j in range(counts[b])]
        return Decodes(nrun, len(at), _Q, upload(at, self.dev))

    def _forward_inputs(self, toks, pos, counts, blocks):
        """(tokens, batch, each row's end in the token list) of rows of ``counts`` tokens."""
        req = [b for b, n in enumerate(counts) for _ in range(n)]
        ends = torch.tensor(counts).cumsum(0).tolist()
        seq = [p[-1] + 1 for p in _split(pos, counts)]
        batch = self.m.fwd.batch(
            upload(pos, self.dev),
            upload(req, self.dev),
            upload(seq, self.dev),
            upload(blocks, self.dev),
        )
        return upload(toks, self.dev), batch, ends

    def run(self) -> None:
        waiting = list(range(len(self.prompts)))
        running: List[int] = []
        while waiting or running:
            # Running requests (one token, or the pending token and its draft) decode first.
            rows = list(running)
            if waiting and len(running) < self.nmax:
                rows.append(waiting.pop(0))
            running = self._step(rows, len(running))

    def _tokens(self, rows: List[int], nrun: int):
        """(tokens, positions, tokens per row) of a verify step: each running row's pending
        token and its draft, then the admitted prompt."""
        toks, pos, counts = [], [], []
        for b, r in enumerate(rows):
            if b >= nrun:  # the admitted prompt
                p = list(self.prompts[r])
                toks += p
                pos += range(len(p))
            else:
                n = self.length[r]
                toks.append(self.out.tokens[r][-1])
                pos.append(n)
                if self.draft[r] is not None:
                    toks.append(self.draft[r])
                    pos.append(n + 1)
            counts.append(len(pos) - sum(counts))
        return toks, pos, counts

    def _wanted(self, rows: List[int], nrun: int, ends: List[int]) -> List[int]:
        """Logits of every verified token: a row's last two (verify), else its last."""
        want = []
        for b, r in enumerate(rows):
            two = b < nrun and self.draft[r] is not None
            want += [ends[b] - 2, ends[b] - 1] if two else [ends[b] - 1]
        return want

    def _step(self, rows: List[int], nrun: int) -> List[int]:
        out, store = self.out, self.store
        toks, pos, counts = self._tokens(rows, nrun)
        blocks = store.begin({f"req-{r}": c for r, c in zip(rows, counts)})
        tokens, batch, ends = self._forward_inputs(toks, pos, counts, blocks)
        want = upload(self._wanted(rows, nrun, ends), self.dev)
        hidden, logits = self.m.target(store, tokens, batch, want, self._decodes(counts, nrun))
        store.end()
        out.target_steps += 1
        top = logits.topk(2, dim=-1).values
        gaps, picked = (top[:, 0] - top[:, 1]).tolist(), logits.argmax(-1).tolist()
        # Draft inputs: (request, tokens, positions, target hidden rows) of confirmed positions.
        drafts, j, still = [], 0, []
        for b, r in enumerate(rows):
            first = ends[b] - counts[b]
            if b >= nrun:  # prefill: every prompt position, the last one's token just picked
                self.length[r] = counts[b]
                out.first_logits[r] = logits[j].float().cpu()
                self._emit(r, picked[j], gaps[j])
                nxt = list(self.prompts[r][1:]) + [picked[j]]
                drafts.append((r, nxt, list(range(counts[b])), list(range(first, ends[b])), True))
                j += 1
            elif self.draft[r] is None:
                n = self.length[r]
                self.length[r] = n + 1
                self._emit(r, picked[j], gaps[j])
                drafts.append((r, [picked[j]], [n], [first], False))
                j += 1
            else:
                n, d = self.length[r], self.draft[r]
                out.proposed += 1
                if picked[j] == d:
                    out.accepted += 1
                    self._emit(r, d, gaps[j])
                    self._emit(r, picked[j + 1], gaps[j + 1])
                    self.length[r] = n + 2
                    drafts.append((r, [d, picked[j + 1]], [n, n + 1], [first, first + 1], False))
                else:
                    self._emit(r, picked[j], gaps[j])
                    self.length[r] = n + 1
                    key = blocks[b] * self.m.fwd.max_context + n + 1
                    out.rejected_keys.append(key)
                    discard(store, f"req-{r}", [key])
                    drafts.append((r, [picked[j]], [n], [first], False))
                j += 2
            left = self.max_new - len(out.tokens[r])
            if left <= 0:
                store.finish(f"req-{r}")
                continue
            still.append(r)
            self.draft[r] = None
        # A request with one token left decodes it plainly: no draft needed.
        self._draft_pass([d for d in drafts if self.max_new - len(out.tokens[d[0]]) >= 2], hidden)
        return still

    def _emit(self, r: int, token: int, gap: float) -> None:
        if len(self.out.tokens[r]) < self.max_new:
            self.out.tokens[r].append(token)
            self.out.gaps[r].append(gap)

    def _draft_pass(self, drafts, hidden: torch.Tensor) -> None:
        if not drafts:
            return
        drafts.sort(key=lambda d: d[4])  # the running requests' one or two tokens: decodes first
        toks = [t for d in drafts for t in d[1]]
        pos = [p for d in drafts for p in d[2]]
        counts = [len(d[1]) for d in drafts]
        src = upload([i for d in drafts for i in d[3]], self.dev)
        blocks = self.store.begin({f"req-{d[0]}": len(d[1]) for d in drafts})
        tokens, batch, ends = self._forward_inputs(toks, pos, counts, blocks)
        nd = self._decodes(counts, sum(not d[4] for d in drafts))
        last = upload([e - 1 for e in ends], self.dev)
        logits = self.m.draft(self.store, tokens, hidden[src], batch, last, nd)
        self.store.end()
        for d, t in zip(drafts, logits.argmax(-1).tolist()):
            self.draft[d[0]] = t


def _split(xs: Sequence[int], counts: Sequence[int]) -> List[List[int]]:
    out, s = [], 0
    for n in counts:
        out.append(list(xs[s : s + n]))
        s += n
    return out
