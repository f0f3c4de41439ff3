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

_ALIGN = 16


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
        if self.row_bytes % _ALIGN:
            raise BindingError(f"row_bytes must be a multiple of {_ALIGN}, got {self.row_bytes}")
        if self.block_stride is None:
            object.__setattr__(self, "block_stride", self.block_size * self.row_bytes)
        if self.layer_stride is None:
            object.__setattr__(self, "layer_stride", self.num_blocks * self.block_stride)
        if self.block_stride < self.block_size * self.row_bytes or self.block_stride % _ALIGN:
            raise BindingError(
                f"block_stride must be a multiple of {_ALIGN} and at least block_size*row_bytes "
                f"= {self.block_size * self.row_bytes}, got {self.block_stride}"
            )
        if self.layer_stride % _ALIGN or self.offset % _ALIGN or self.offset < 0:
            raise BindingError(
                f"offset and layer_stride must be non-negative multiples of {_ALIGN}, got "
                f"offset={self.offset} layer_stride={self.layer_stride}"
            )
        if len(names) > 1 and self.layer_stride < self.layer_bytes:
            raise BindingError(
                f"layer_stride {self.layer_stride} is smaller than one layer's span "
                f"{self.layer_bytes}: layers would overlap"
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
    if (raw.data_ptr() + start) % _ALIGN:
        raise BindingError(f"layer {layout.layer_names[index]!r} is not {_ALIGN}-byte aligned")
    return raw.as_strided(
        (layout.num_blocks, layout.block_size, layout.row_bytes),
        (layout.block_stride, layout.row_bytes, 1),
        raw.storage_offset() + start,
    )


def _span(view: torch.Tensor) -> tuple:
    first = view.data_ptr()
    last = first + sum((s - 1) * st for s, st in zip(view.shape, view.stride())) + 1
    return first, last


def bind_layers(raw: torch.Tensor, layout: PackedLayout) -> dict:
    """Every layer's view, checked to lie inside ``raw`` and not to overlap another layer."""
    views = {name: layer_view(raw, layout, i) for i, name in enumerate(layout.layer_names)}
    check_disjoint(views)
    return views


def check_disjoint(views: dict) -> None:
    """BindingError if any two views' byte ranges overlap."""
    spans = sorted((_span(v), name) for name, v in views.items())
    for (a, name_a), (b, name_b) in zip(spans, spans[1:]):
        if b[0] < a[1]:
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
