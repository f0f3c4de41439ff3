"""Hybrid residency's policy for the DSA engine: which requests hold device pages (blocks of
``block`` rows out of a fixed budget) and which live in the host pool, decided on the host from
token counts only, so it is the same on every device.

1. Admission: a new request gets device pages when its prompt's pages fit and leave at least one
   free page per resident request (itself included) as growth headroom; else it is admitted
   spilled, where fewer than ``max_spilled`` are (each spilled request holds a hot buffer);
   else it waits (``can_admit``).
2. Growth: a resident request entering a new page takes a free one; with none free, the resident
   request admitted last is spilled whole (repeatedly, itself at the latest); with
   ``max_spilled`` already spilled that is an error naming the budget to raise.
3. Returns: spilled requests come back, oldest spill first, while their pages (one more than they
   hold) fit with the same headroom left; never in the step that spilled them.

The moves themselves (copying rows to or from the host pool) are the store's
(``hisparse.engine.dsa.hybrid.HybridRows``); this class only hands out and takes back pages.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

from hisparse.engine.dsa.stores import BLOCK


class Residency:
    """Pages ``[0, num_pages)`` of ``block`` rows each, for requests known by their slot."""

    def __init__(self, num_pages: int, block: int, max_spilled: Optional[int] = None) -> None:
        self.block = block
        self.max_spilled = max_spilled
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

    def _fits(self, tokens: int) -> bool:
        return len(self.free) - self.need(tokens) >= len(self.pages) + 1

    def _spill_room(self) -> bool:
        return self.max_spilled is None or len(self.spill_order) < self.max_spilled

    def can_admit(self, tokens: int) -> bool:
        """Rule 1's test: a request of ``tokens`` prompt tokens is admitted now (resident or
        spilled), not left waiting."""
        return self._fits(tokens) or self._spill_room()

    def admit(self, slot: int, tokens: int) -> bool:
        """Rule 1: True when the request of ``tokens`` prompt tokens is resident."""
        if not self.can_admit(tokens):
            raise RuntimeError(
                f"hybrid residency: a request of {tokens} tokens fits neither the free device "
                f"pages nor a hot buffer ({self.max_spilled} spilled already); ask can_admit first"
            )
        self._seq += 1
        self.admitted[slot] = self._seq
        if self._fits(tokens):
            self.pages[slot] = [self.free.pop() for _ in range(self.need(tokens))]
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
            if not self._spill_room():
                raise RuntimeError(
                    f"hybrid residency: a resident request needs a device page and every one of "
                    f"the {self.max_spilled} hot buffers holds a spilled request; raise "
                    "device_blocks or hot_slots"
                )
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


def _count(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def check_device_blocks(device_blocks, mode: str, hot_slots=None) -> None:
    """One-line errors for the budget: integers >= 1, for mode 'hybrid' only."""
    if mode != "hybrid":
        if device_blocks is not None or hot_slots is not None:
            raise ValueError(
                f"device_blocks and hot_slots apply to mode 'hybrid' only, not {mode!r}"
            )
        return
    if not _count(device_blocks):
        raise ValueError(
            f"device_blocks must be an integer >= 1 (device pages of {BLOCK} rows) for mode "
            f"'hybrid', got {device_blocks!r}"
        )
    if hot_slots is not None and not _count(hot_slots):
        raise ValueError(f"hot_slots must be an integer >= 1 or None, got {hot_slots!r}")
