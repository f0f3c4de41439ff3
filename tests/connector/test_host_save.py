"""``host_save.save_kv_rows`` alone: each row lands in the host-pool row its slot names (and in its
own layer's bytes of a token-major group), padding slots are skipped without touching any row, and
a slot mapping that does not fit the rows or the pool is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from hisparse.connector.host_save import save_kv_rows
from tests.helpers import cpu_registration

HOST_ROWS = 12


def _layers():
    """Layers l0 (16-byte rows) and l1 (32) of one index group: their host rows interleave. The
    pool is zeroed here (it is allocated uninitialised) so that every write shows."""
    _, reg, _ = cpu_registration(("l0", "l1"), (16, 32), host_rows=HOST_ROWS, index_share=2)
    reg.host_pool.raw.zero_()
    return reg.runtimes["l0"], reg.runtimes["l1"], reg.host_pool.raw


def _host(rt):
    return rt.host_view.reshape(-1, rt.row_bytes)


def _rows(n, rb, first=1):
    return (first + torch.arange(n * rb) % 251).to(torch.uint8).reshape(n, rb)


@pytest.mark.parametrize(
    "slots",
    [[5, 0, 11], torch.tensor([5, 0, 11]), torch.tensor([[5], [0], [11]], dtype=torch.int32)],
    ids=["list", "tensor", "int32-column"],
)
def test_each_row_lands_at_its_slot_and_no_other_row_changes(slots):
    l0, _, _ = _layers()
    rows = _rows(3, 16)
    save_kv_rows(l0, rows, slots, HOST_ROWS)
    want = torch.zeros(HOST_ROWS, 16, dtype=torch.uint8)
    want[[5, 0, 11]] = rows
    assert torch.equal(_host(l0), want)


def test_a_followers_rows_land_in_its_own_bytes_of_the_shared_token_rows():
    l0, l1, raw = _layers()
    save_kv_rows(l0, torch.full((1, 16), 7, dtype=torch.uint8), [4], HOST_ROWS)
    rows = _rows(2, 32)
    save_kv_rows(l1, rows, [4, 9], HOST_ROWS)
    token = raw.view(HOST_ROWS, 48)  # l0's 16 bytes then l1's 32 bytes of every token
    assert torch.equal(token[4, :16], torch.full((16,), 7, dtype=torch.uint8))
    assert torch.equal(token[4, 16:], rows[0]) and torch.equal(token[9, 16:], rows[1])
    assert int(token[9, :16].sum()) == 0  # l0's bytes of token 9 untouched
    assert int(token.sum()) == 7 * 16 + int(rows.sum(dtype=torch.int64))


def test_padding_slots_are_skipped_and_never_wrap_to_the_last_row():
    l0, _, _ = _layers()
    rows = _rows(4, 16)
    save_kv_rows(l0, rows, [3, -1, 5, -4], HOST_ROWS)
    host = _host(l0)
    assert torch.equal(host[3], rows[0]) and torch.equal(host[5], rows[2])
    assert int(host[HOST_ROWS - 1].sum()) == 0 and int(host[HOST_ROWS - 4].sum()) == 0
    assert int((host.sum(dim=1) > 0).sum()) == 2
    save_kv_rows(l0, _rows(2, 16, first=50), [-1, -1], HOST_ROWS)  # all padding: no write
    assert torch.equal(host[3], rows[0]) and int((host.sum(dim=1) > 0).sum()) == 2


def test_rows_of_any_dtype_and_layout_are_saved_as_their_bytes():
    l0, l1, _ = _layers()
    typed = torch.randn(2, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_kv_rows(l1, typed, [1, 2], HOST_ROWS)  # 16 bf16 = one 32-byte row each
    assert torch.equal(_host(l1)[1:3], typed.view(torch.uint8))
    strided = _rows(2, 32)[:, ::2]  # not contiguous: 16 bytes a row
    save_kv_rows(l0, strided, torch.tensor([6, 8]), HOST_ROWS)
    assert torch.equal(_host(l0)[[6, 8]], strided)
    shaped = _rows(2, 16).reshape(2, 1, 16)  # [n, heads, head_size]
    save_kv_rows(l0, shaped, [10, 11], HOST_ROWS)
    assert torch.equal(_host(l0)[10:12], shaped.reshape(2, 16))


@pytest.mark.parametrize(
    "rows, slots, says",
    [
        (
            _rows(2, 16),
            [3, 12],
            "slot_mapping of 'l0' holds slot 12, outside the host pool's 12 rows",
        ),
        (
            _rows(1, 16),
            [2**31],
            "holds slot 2147483648, which is no valid key .* not the pool size",
        ),
        (_rows(2, 16), [3], "kv_layer of 'l0' has 2 rows but slot_mapping has 1 entries"),
        (_rows(1, 24), [3], "kv_layer of 'l0' is not a whole number of 16-byte rows"),
        ([[0] * 16], [3], "kv_layer must be a tensor, got list"),
        (_rows(1, 16), torch.tensor([3], device="meta"), "slot_mapping is on meta; it must be"),
    ],
    ids=["past-pool", "past-int32", "count", "partial-row", "not-tensor", "device"],
)
def test_a_slot_mapping_that_does_not_fit_is_refused_before_any_write(rows, slots, says):
    l0, l1, raw = _layers()
    with pytest.raises(ValueError, match=says):
        save_kv_rows(l0, rows, slots, HOST_ROWS)
    assert int(raw.sum()) == 0  # nothing written, not even the valid slots
