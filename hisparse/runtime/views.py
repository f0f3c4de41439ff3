"""Per-layer views into packed allocations.

Several layers can share one raw allocation: layer i starts at ``offset + i * layer_stride``
bytes and its blocks are ``block_stride`` bytes apart. Every view is built from its own layer's
offset; binding all layers at the base offset makes later layers overwrite earlier ones (the
upstream bug this module exists to prevent).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hisparse.ops.limits import ROW_ALIGN


class BindingError(ValueError):
    """A view would run past its allocation, overlap another layer, or disagree with its alias."""


@dataclass(frozen=True)
class PackedLayout:
    layer_names: tuple
    num_blocks: int
    block_size: int
    row_bytes: int
    block_stride: Optional[int] = None
    layer_stride: Optional[int] = None
    offset: int = 0

    def __post_init__(self) -> None:
        names = tuple(self.layer_names)
        object.__setattr__(self, "layer_names", names)
        if not names or len(set(names)) != len(names):
            raise BindingError(f"layer_names must be non-empty and unique, got {names!r}")
        for field in ("num_blocks", "block_size", "row_bytes"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise BindingError(f"{field} must be a positive int, got {v!r}")
        if self.row_bytes % ROW_ALIGN:
            raise BindingError(f"row_bytes must be a multiple of {ROW_ALIGN}, got {self.row_bytes}")
        if self.block_stride is None:
            object.__setattr__(self, "block_stride", self.block_size * self.row_bytes)
        if self.layer_stride is None:
            object.__setattr__(self, "layer_stride", self.num_blocks * self.block_stride)
        if self.block_stride < self.block_size * self.row_bytes or self.block_stride % ROW_ALIGN:
            raise BindingError(
                f"block_stride must be a multiple of {ROW_ALIGN} and at least block_size*row_bytes "
                f"= {self.block_size * self.row_bytes}, got {self.block_stride}"
            )
        if self.layer_stride % ROW_ALIGN or self.offset % ROW_ALIGN or self.offset < 0:
            raise BindingError(
                f"offset and layer_stride must be non-negative multiples of {ROW_ALIGN}, got "
                f"offset={self.offset} layer_stride={self.layer_stride}"
            )
        run = self.block_size * self.row_bytes
        for m in range(1, len(names)):  # layers i and i+m are offset by m * layer_stride
            if _runs_overlap(
                m * self.layer_stride,
                self.num_blocks,
                self.block_stride,
                run,
                self.num_blocks,
                self.block_stride,
                run,
            ):
                raise BindingError(
                    f"layer_stride {self.layer_stride} with block_stride {self.block_stride}: "
                    f"layers {names[0]!r} and {names[m]!r} would overlap"
                )

    @property
    def rows(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def layer_bytes(self) -> int:
        """Bytes one layer's view spans, from its first byte to the end of its last row."""
        return (self.num_blocks - 1) * self.block_stride + self.block_size * self.row_bytes

    def layer_offset(self, index: int) -> int:
        return self.offset + index * self.layer_stride

    def nbytes(self) -> int:
        return self.layer_offset(len(self.layer_names) - 1) + self.layer_bytes


def layer_view(raw: torch.Tensor, layout: PackedLayout, index: int) -> torch.Tensor:
    """Layer ``index``'s strided view [num_blocks, block_size, row_bytes] into ``raw``."""
    if raw.dtype != torch.uint8 or raw.dim() != 1 or not raw.is_contiguous():
        raise BindingError("raw must be a contiguous 1-D uint8 tensor")
    if not 0 <= index < len(layout.layer_names):
        raise BindingError(f"layer index {index} out of range for {len(layout.layer_names)} layers")
    start = layout.layer_offset(index)
    end = start + layout.layer_bytes
    if end > raw.numel():
        raise BindingError(
            f"layer {layout.layer_names[index]!r} spans bytes [{start}, {end}) but the "
            f"allocation has {raw.numel()} bytes"
        )
    if (raw.data_ptr() + start) % ROW_ALIGN:
        raise BindingError(f"layer {layout.layer_names[index]!r} is not {ROW_ALIGN}-byte aligned")
    return raw.as_strided(
        (layout.num_blocks, layout.block_size, layout.row_bytes),
        (layout.block_stride, layout.row_bytes, 1),
        raw.storage_offset() + start,
    )


def _runs_overlap(d: int, n_a: int, s_a: int, len_a: int, n_b: int, s_b: int, len_b: int) -> bool:
    """Do n_a runs of len_a bytes, s_a apart, starting at 0, and n_b runs of len_b bytes, s_b
    apart, starting at d, share a byte? Exact when the strides agree or either side is one run."""
    if n_a <= 0 or n_b <= 0 or len_a <= 0 or len_b <= 0:
        return False
    end_a = (n_a - 1) * s_a + len_a
    end_b = d + (n_b - 1) * s_b + len_b
    if end_a <= d or end_b <= 0:
        return False  # the spans are apart
    if n_a == 1 and n_b == 1:
        return True
    if n_a == 1:  # one run against many: mirror so that `a` has the stride
        return _runs_overlap(-d, n_b, s_b, len_b, n_a, s_b, len_a)
    if n_b > 1 and s_a != s_b:
        return True  # different strides: the span test above is all we claim
    s = s_a
    # run i of a meets run j of b iff -len_b < d + (j - i) * s < len_a; with k = i - j:
    # (d - len_a) / s < k < (d + len_b) / s and -(n_b - 1) <= k <= n_a - 1.
    k_lo = max((d - len_a) // s + 1, -(n_b - 1))
    k_hi = min(-((-(d + len_b)) // s) - 1, n_a - 1)
    return k_lo <= k_hi


def _runs(view: torch.Tensor) -> tuple:
    """(first byte address, runs, run stride, run length) of a uint8 view whose rows are
    contiguous within a block; anything else is described by its whole span as one run."""
    if view.numel() == 0:
        return view.data_ptr(), 0, 0, 0
    if view.dim() == 3 and view.stride(2) == 1 and view.stride(1) == view.shape[2]:
        return view.data_ptr(), view.shape[0], view.stride(0), view.shape[1] * view.shape[2]
    if view.dim() == 2 and view.stride(1) == 1:
        return view.data_ptr(), view.shape[0], view.stride(0), view.shape[1]
    span = sum((n - 1) * st for n, st in zip(view.shape, view.stride())) + view.element_size()
    return view.data_ptr(), 1, 0, span


def bind_layers(raw: torch.Tensor, layout: PackedLayout) -> dict:
    """Every layer's view, checked to lie inside ``raw`` and not to overlap another layer."""
    views = {name: layer_view(raw, layout, i) for i, name in enumerate(layout.layer_names)}
    check_disjoint(views)
    return views


def check_disjoint(views: dict) -> None:
    """BindingError if any two views share a byte (interleaved layouts are fine)."""
    for name, v in views.items():
        if v.dtype != torch.uint8:
            raise BindingError(f"layer {name!r}: views must be uint8 byte views, got {v.dtype}")
    items = [(name, _runs(v)) for name, v in views.items()]
    for i, (name_a, (pa, na, sa, la)) in enumerate(items):
        for name_b, (pb, nb, sb, lb) in items[i + 1 :]:
            if _runs_overlap(pb - pa, na, sa, la, nb, sb, lb):
                raise BindingError(f"layers {name_a!r} and {name_b!r} overlap in memory")


def check_same_view(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """BindingError unless ``a`` and ``b`` are the same bytes with the same geometry."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        raise BindingError(f"{what}: views live in different allocations")
    if a.data_ptr() != b.data_ptr():
        raise BindingError(f"{what}: data pointers differ ({a.data_ptr():#x} vs {b.data_ptr():#x})")
    if a.shape != b.shape or a.stride() != b.stride():
        raise BindingError(
            f"{what}: geometry differs (shape {tuple(a.shape)} vs {tuple(b.shape)}, "
            f"stride {a.stride()} vs {b.stride()})"
        )
