"""Hybrid residency's step plan and page table (``hisparse.engine.dsa.routes``) on the CPU: where
a mixed step's rows go, and a page table that writes only what changed yet always equals the
residency's pages."""

from __future__ import annotations

import pytest
import torch

from hisparse.engine.dsa.routes import PageTable, route

BLOCK, CONTEXT = 16, 64


def test_a_mixed_step_routes_resident_rows_to_pages_and_spilled_ones_to_the_host():
    # slot 0 resident (pages 5, 2) decodes at position 20, slot 1 spilled decodes at 7,
    # slot 2 spilled is admitted with 3 prompt tokens
    r = route([0, 1, 2], [1, 1, 3], {0: 20, 1: 7, 2: 0}, {0: [5, 2]}, CONTEXT, BLOCK)
    assert (r.dev_src, r.dev_dst) == ([0], [2 * BLOCK + 4])
    assert r.host_keys == [-1, 1 * CONTEXT + 7, 2 * CONTEXT, 2 * CONTEXT + 1, 2 * CONTEXT + 2]
    assert r.sp_dec == [1] and r.prefill_host
    with pytest.raises(ValueError, match="all be spilled or resident"):
        route([0, 1, 2], [1, 3, 3], {0: 20, 1: 0, 2: 0}, {0: [5, 2], 1: [1]}, CONTEXT, BLOCK)


def test_the_page_table_writes_only_new_entries_and_rewrites_a_returned_slot():
    t = PageTable(3, CONTEXT, BLOCK, torch.device("cpu"))
    pages = {0: [4], 2: [1, 3]}
    t.update([0, 1, 2], pages)
    assert t.dev[0, :1].tolist() == [4] and t.dev[2, :2].tolist() == [1, 3]
    assert t.dev[1].tolist() == [0, 0, 0, 0]  # spilled: never written
    t.dev[0, 0] = -9  # already written entries are not written again...
    pages[0].append(7)
    t.update([0, 2], pages)
    assert t.dev[0, :2].tolist() == [-9, 7]
    t.forget(0)  # ...until the slot lost its pages: then all of them
    pages[0] = [0, 6]
    t.update([0], pages)
    assert t.dev[0, :2].tolist() == [0, 6]
