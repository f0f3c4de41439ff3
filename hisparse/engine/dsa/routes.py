"""Where one hybrid-residency step's new rows go and what its decodes read, planned on the host
from the residency's pages (``hisparse.engine.dsa.hybrid.HybridRows`` uploads and applies it).

Per step, in batch order: a resident request's new rows go to its pages (``dev_src`` rows of
the step to ``dev_dst`` device rows, host key -1), a spilled one's to the host pool (its keys
``slot * context + position``); ``sp_dec`` are the batch rows of spilled decodes (the
connector's batch). ``dirty``: resident slots whose page-table row is out of date.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List


@dataclass
class Route:
    dev_src: List[int] = field(default_factory=list)
    dev_dst: List[int] = field(default_factory=list)
    host_keys: List[int] = field(default_factory=list)
    sp_dec: List[int] = field(default_factory=list)
    dirty: List[int] = field(default_factory=list)
    prefill_host: bool = False  # the step's prefills are spilled (they read the host pool)


def route(
    slots: List[int],
    new_tokens: List[int],
    held: Dict[int, int],
    pages: Dict[int, List[int]],
    table_len: Dict[int, int],
    context: int,
    block: int,
) -> Route:
    """The step of requests ``slots`` (batch order) adding ``new_tokens`` each after the
    ``held`` positions they have; ``pages``: resident slots' pages; ``table_len``: pages already
    in each resident slot's page-table row."""
    r = Route()
    res_dec = spilled_pre = t = 0
    for b, (s, n) in enumerate(zip(slots, new_tokens)):
        lo, own = held[s], pages.get(s)
        if own is not None:
            r.dev_src += range(t, t + n)
            r.dev_dst += (own[p // block] * block + p % block for p in range(lo, lo + n))
            r.host_keys += [-1] * n
            if table_len.get(s) != len(own):
                r.dirty.append(s)
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
