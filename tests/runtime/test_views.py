"""Per-layer binding into packed allocations, with the upstream bug as a negative control."""

from __future__ import annotations

import pytest
import torch

from hisparse.runtime.views import (
    BindingError,
    PackedLayout,
    bind_layers,
    check_disjoint,
    check_same_view,
    layer_view,
)

LAYOUT = PackedLayout(
    ("l0", "l1", "l2"),
    num_blocks=3,
    block_size=4,
    row_bytes=32,
    block_stride=160,
    layer_stride=512,
    offset=64,
)


def _fill_each_layer(views):
    for i, v in enumerate(views.values()):
        v.fill_(i + 1)


def _base_offset_binding(raw, layout):
    """The upstream bug: every layer bound at the tensor config's base offset."""
    return {
        name: raw.as_strided(
            (layout.num_blocks, layout.block_size, layout.row_bytes),
            (layout.block_stride, layout.row_bytes, 1),
            layout.offset,
        )
        for name in layout.layer_names
    }


def test_layer_views_start_at_offset_plus_index_times_layer_stride():
    raw = torch.zeros(LAYOUT.nbytes(), dtype=torch.uint8)
    views = bind_layers(raw, LAYOUT)
    for i, v in enumerate(views.values()):
        assert v.data_ptr() - raw.data_ptr() == 64 + i * 512
        assert v.stride() == (160, 32, 1)
        assert v.shape == (3, 4, 32)


def test_real_binding_keeps_layers_apart():
    raw = torch.zeros(LAYOUT.nbytes(), dtype=torch.uint8)
    views = bind_layers(raw, LAYOUT)
    _fill_each_layer(views)
    for i, v in enumerate(views.values()):
        assert bool((v == i + 1).all()), f"layer {i} was overwritten"
    # bytes between blocks and before the offset are untouched
    assert int(raw[:64].sum()) == 0
    assert int(raw[64 + 128 : 64 + 160].sum()) == 0


def test_negative_control_base_offset_binding_overwrites_layers():
    raw = torch.zeros(LAYOUT.nbytes(), dtype=torch.uint8)
    broken = _base_offset_binding(raw, LAYOUT)
    _fill_each_layer(broken)
    survivors = [bool((v == i + 1).all()) for i, v in enumerate(broken.values())]
    assert survivors == [False, False, True]  # only the last writer's bytes remain
    with pytest.raises(BindingError, match="overlap"):
        check_disjoint(broken)


def test_view_past_allocation_rejected():
    raw = torch.zeros(LAYOUT.nbytes() - 1, dtype=torch.uint8)
    with pytest.raises(BindingError, match="'l2' spans bytes"):
        bind_layers(raw, LAYOUT)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(layer_stride=256), "would overlap"),
        (dict(layer_stride=64, block_stride=256), "would overlap"),  # interleaved, rows collide
        (dict(block_stride=96), "block_stride"),
        (dict(row_bytes=40), "row_bytes must be a multiple of 16"),
        (dict(offset=8), "offset and layer_stride"),
        (dict(num_blocks=0), "num_blocks must be a positive int"),
        (dict(layer_names=("a", "a")), "unique"),
    ],
)
def test_bad_layouts_rejected(kwargs, match):
    base = dict(layer_names=("a", "b"), num_blocks=3, block_size=4, row_bytes=32)
    base.update(kwargs)
    with pytest.raises(BindingError, match=match):
        PackedLayout(**base)


def test_misaligned_raw_rejected():
    raw = torch.zeros(LAYOUT.nbytes() + 1, dtype=torch.uint8)[1:]
    with pytest.raises(BindingError, match="aligned"):
        layer_view(raw, LAYOUT, 0)


def test_check_same_view():
    raw = torch.zeros(LAYOUT.nbytes(), dtype=torch.uint8)
    a = layer_view(raw, LAYOUT, 1)
    check_same_view(a, layer_view(raw, LAYOUT, 1), "hot vs resident")
    with pytest.raises(BindingError, match="data pointers differ"):
        check_same_view(a, layer_view(raw, LAYOUT, 0), "hot vs resident")
    with pytest.raises(BindingError, match="different allocations"):
        check_same_view(a, layer_view(raw.clone(), LAYOUT, 1), "hot vs resident")
    with pytest.raises(BindingError, match="geometry differs"):
        check_same_view(a, a[:2], "hot vs resident")


def test_default_strides_pack_tightly():
    lay = PackedLayout(("a", "b"), num_blocks=2, block_size=3, row_bytes=16)
    assert (lay.block_stride, lay.layer_stride, lay.nbytes()) == (48, 96, 192)


def test_interleaved_layout_packs_layers_block_by_block():
    """Layers of one group side by side inside each block (docs/hardware.md): legal, disjoint."""
    lay = PackedLayout(
        ("a", "b", "c"),
        num_blocks=4,
        block_size=2,
        row_bytes=32,
        layer_stride=64,
        block_stride=3 * 64,
    )
    raw = torch.zeros(lay.nbytes(), dtype=torch.uint8)
    views = bind_layers(raw, lay)
    _fill_each_layer(views)
    for i, v in enumerate(views.values()):
        assert bool((v == i + 1).all())
    assert int((raw == 0).sum()) == 0  # the three layers tile the allocation exactly


def test_check_disjoint_is_exact_for_strided_views():
    raw = torch.zeros(4096, dtype=torch.uint8)
    a = raw.as_strided((4, 2, 32), (256, 32, 1), 0)  # bytes [0,64) of every 256
    b = raw.as_strided((4, 2, 32), (256, 32, 1), 64)  # [64,128): interleaved, disjoint
    c = raw.as_strided((1, 2, 32), (256, 32, 1), 900)  # [900,964): past every block of a, b
    check_disjoint({"a": a, "b": b, "c": c})
    d = raw.as_strided((2, 32), (32, 1), 920)  # [920,984) overlaps c
    with pytest.raises(BindingError, match="'c' and 'd'"):
        check_disjoint({"a": a, "c": c, "d": d})
    e = raw.as_strided((1, 32), (32, 1), 512 + 40)  # inside a's 3rd block [512,576)
    with pytest.raises(BindingError, match="'a' and 'e'"):
        check_disjoint({"a": a, "e": e})
