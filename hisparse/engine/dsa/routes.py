"""Where one hybrid-residency step's new rows go and what its decodes read, planned on the host
from the residency's pages (``hisparse.engine.dsa.hybrid.HybridRows`` uploads and applies it).

Per step, in batch order: a resident request's new rows go to its pages (``dev_src`` rows of
the step to ``dev_dst`` device rows, host key -1), a spilled one's to the host pool (its keys
``slot * context + position``); ``sp_dec`` are the batch rows of spilled decodes (the
connector's batch). ``PageTable``: resident slots' pages on the device, which attention and
the saves of an all-resident step read through ``kernels.pages.page_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List

import torch

from hisparse.engine.dsa.stores import upload
from hisparse.models.dsa.kernels.pages import check_table


@dataclass
class Route:
    dev_src: List[int] = field(default_factory=list)
    dev_dst: List[int] = field(default_factory=list)
    host_keys: List[int] = field(default_factory=list)
    sp_dec: List[int] = field(default_factory=list)
    prefill_host: bool = False  # the step's prefills are spilled (they read the host pool)


def route(
    slots: List[int],
    new_tokens: List[int],
    held: Dict[int, int],
    pages: Dict[int, List[int]],
    context: int,
    block: int,
) -> Route:
    """The step of requests ``slots`` (batch order) adding ``new_tokens`` each after the
    ``held`` positions they have; ``pages``: resident slots' pages."""
    r = Route()
    res_dec = spilled_pre = t = 0
    for b, (s, n) in enumerate(zip(slots, new_tokens)):
        lo, own = held[s], pages.get(s)
        if own is not None:
            r.dev_src += range(t, t + n)
            r.dev_dst += (own[p // block] * block + p % block for p in range(lo, lo + n))
            r.host_keys += [-1] * n
        else:
            r.host_keys += range(s * context + lo, s * context + lo + n)
        if lo and own is None:
            r.sp_dec.append(b)
        elif lo:
            res_dec += 1
        elif own is None:
            spilled_pre += 1
        t += n
    prefills = len(slots) - res_dec - len(r.sp_dec)
    if spilled_pre and spilled_pre != prefills:
        raise ValueError("hybrid residency: a step's prefills must all be spilled or resident")
    r.prefill_host = bool(spilled_pre)
    return r


class PageTable:
    """``dev`` [slots, pages] on the device, updated in place (CUDA graphs read it): each
    resident slot's pages. A resident slot's pages only grow, so only new entries are written;
    a slot that lost its pages (``forget``) is written whole when it has some again."""

    def __init__(self, slots: int, context: int, block: int, device: torch.device) -> None:
        self.dev = torch.zeros(slots, -(-context // block), dtype=torch.int64, device=device)
        check_table(self.dev, context, block)
        self.written: Dict[int, int] = {}  # slot -> its pages in ``dev``

    def update(self, slots: Iterable[int], pages: Dict[int, List[int]]) -> None:
        """The entries of the resident ``slots``' ``pages`` not yet written: one upload."""
        at: List[int] = []
        values: List[int] = []
        width = self.dev.shape[1]
        for s in slots:
            own = pages.get(s)
            done = self.written.get(s, 0)
            if own is not None and done != len(own):
                at += range(s * width + done, s * width + len(own))
                values += own[done:]
                self.written[s] = len(own)
        if not at:
            return
        flat = upload(at + values, self.dev.device)
        self.dev.view(-1).index_copy_(0, flat[: len(at)], flat[len(at) :])

    def forget(self, slot: int) -> None:
        """``slot``'s pages are another's now (spilled or finished)."""
        self.written.pop(slot, None)
