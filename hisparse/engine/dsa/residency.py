"""Hybrid residency's policy for the DSA engine: which requests hold device pages (blocks of
``block`` rows out of a fixed budget) and which live in the host pool, decided on the host from
token counts only, so it is the same on every device.

1. Admission: a new request gets device pages when its prompt's pages fit and leave at least one
   free page per resident request (itself included) as growth headroom; else it is admitted
   spilled.
2. Growth: a resident request entering a new page takes a free one; with none free, the resident
   request admitted last is spilled whole (repeatedly, itself at the latest).
3. Returns: spilled requests come back, oldest spill first, while their pages (one more than they
   hold) fit with the same headroom left; never in the step that spilled them.

The moves themselves (copying rows to or from the host pool) are the store's
(``hisparse.engine.dsa.hybrid.HybridRows``); this class only hands out and takes back pages.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple


class Residency:
    """Pages ``[0, num_pages)`` of ``block`` rows each, for requests known by their slot."""

    def __init__(self, num_pages: int, block: int) -> None:
        self.block = block
        self.free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() = lowest
        self.pages: Dict[int, List[int]] = {}  # resident slot -> its pages, position order
        self.admitted: Dict[int, int] = {}  # slot -> admission order
        self.spill_order: List[int] = []  # spilled slots, oldest spill first
        self._seq = 0

    def need(self, tokens: int) -> int:
        """Pages that hold ``tokens`` positions."""
        return -(-tokens // self.block)

    def resident(self, slot: int) -> bool:
        return slot in self.pages

    def row(self, slot: int, pos: int) -> int:
        """The device row of a resident request's position."""
        return self.pages[slot][pos // self.block] * self.block + pos % self.block

    def admit(self, slot: int, tokens: int) -> bool:
        """Rule 1: True when the request of ``tokens`` prompt tokens is resident."""
        self._seq += 1
        self.admitted[slot] = self._seq
        need = self.need(tokens)
        if len(self.free) - need >= len(self.pages) + 1:
            self.pages[slot] = [self.free.pop() for _ in range(need)]
            return True
        self.spill_order.append(slot)
        return False

    def grow(self, slot: int, tokens: int) -> List[Tuple[int, List[int]]]:
        """Rule 2 for a request that will hold ``tokens`` positions after this step: the
        requests spilled for it, each with the pages it held (free again: the caller copies
        their rows out before anything writes to them)."""
        spilled: List[Tuple[int, List[int]]] = []
        while slot in self.pages and len(self.pages[slot]) < self.need(tokens):
            if self.free:
                self.pages[slot].append(self.free.pop())
                continue
            victim = max(self.pages, key=self.admitted.__getitem__)
            spilled.append((victim, self.pages[victim]))
            self._give_back(self.pages.pop(victim))
            self.spill_order.append(victim)
        return spilled

    def returns(self, held: Dict[int, int], skip: Iterable[int]) -> List[int]:
        """Rule 3: spilled slots that get pages back now (``held``: each slot's positions so
        far; ``skip``: slots that may not come back in this step), their pages assigned."""
        skip = set(skip)
        back = []
        for slot in list(self.spill_order):
            if slot in skip:
                continue
            need = self.need(held[slot] + 1)
            if len(self.free) - need < len(self.pages) + 1:
                break
            self.pages[slot] = [self.free.pop() for _ in range(need)]
            self.spill_order.remove(slot)
            back.append(slot)
        return back

    def release(self, slot: int) -> None:
        """A finished request gives back its pages (resident) or leaves the spilled ones."""
        if slot in self.pages:
            self._give_back(self.pages.pop(slot))
        elif slot in self.spill_order:
            self.spill_order.remove(slot)
        self.admitted.pop(slot, None)

    def _give_back(self, pages: List[int]) -> None:
        self.free.extend(pages)
        self.free.sort(reverse=True)
