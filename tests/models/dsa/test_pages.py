"""Keys to device rows through a page table (``hisparse.models.dsa.kernels.pages``): the torch
reference against a loop over the keys, and the table's one-line errors. The CUDA kernel is
checked against the reference in tests/engine/dsa/test_hybrid_cuda.py."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.dsa.kernels.pages import check_table, page_rows, page_rows_torch


def test_reference_maps_each_key_through_its_slots_page():
    block, context, slots = 16, 64, 3
    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 1000, (slots, context // block), generator=g)
    keys = torch.randint(-1, slots * context, (5, 9), generator=g)
    keys[0, 0] = -1
    want = [
        -1 if k < 0 else int(table[k // context, (k % context) // block]) * block + k % block
        for k in keys.view(-1).tolist()
    ]
    got = page_rows_torch(keys, table, block)
    assert got.shape == keys.shape and got.view(-1).tolist() == want
    assert torch.equal(page_rows(keys, table, block), got)  # the CPU path is the reference


@pytest.mark.parametrize(
    "shape, context, block, match",
    [
        ((2, 4), 64, 16, None),
        ((2, 4), 64, 12, "power of two"),
        ((2, 4), 60, 16, "multiple of block"),
        ((2, 5), 64, 16, r"\[slots, 4\]"),
    ],
)
def test_check_table(shape, context, block, match):
    table = torch.zeros(shape, dtype=torch.int64)
    if match is None:
        check_table(table, context, block)
        return
    with pytest.raises(ValueError, match=match):
        check_table(table, context, block)
