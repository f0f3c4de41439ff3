"""Byte layouts of one latent KV row (what the host pool, the hot buffers and the resident cache
store), and their encoders / decoders.

A row is the MLA latent of one token in one layer: 512 latent values plus 64 rotary values.

* ``fp8``  (656 B): 512 x float8_e4m3fn latent (4 tiles of 128, one float32 scale each:
  16 B of scales) followed by 64 x bfloat16 rope values (128 B). DeepSeek-V3.2's FP8 MLA row.
* ``bf16`` (1152 B): 576 x bfloat16 (latent then rope).
* ``f32``  (2304 B): 576 x float32 (latent then rope): no rounding past the model's own float32,
  for comparing with an unquantized reference.

Both are multiples of 16 B, as the gather kernels require. Encoding rounds the values (that is
the point of storing bytes); decoding is exact, so two rows with the same bytes decode to the
same values on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LATENT_DIM = 512
ROPE_DIM = 64
KV_DIM = LATENT_DIM + ROPE_DIM
FP8_TILE = 128
FP8_MAX = 448.0


@dataclass(frozen=True)
class RowFormat:
    name: str
    row_bytes: int


ROW_FORMATS = {
    "fp8": RowFormat("fp8", LATENT_DIM + 4 * (LATENT_DIM // FP8_TILE) + 2 * ROPE_DIM),  # 656
    "bf16": RowFormat("bf16", 2 * KV_DIM),  # 1152
    "f32": RowFormat("f32", 4 * KV_DIM),  # 2304
}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """[..., n] tensor -> [..., n * itemsize] uint8 (same bytes)."""
    return t.contiguous().view(torch.uint8)


def encode_rows(kv: torch.Tensor, layout: str) -> torch.Tensor:
    """[..., 576] float -> [..., row_bytes] uint8."""
    if kv.shape[-1] != KV_DIM:
        raise ValueError(f"kv rows must have {KV_DIM} values, got {kv.shape[-1]}")
    # Every narrowing goes through float32 first: a direct float64 -> fp8/bf16 conversion rounds
    # once on some devices and twice (via float32) on others, which would make CPU and CUDA
    # store different bytes. float64 -> float32 -> narrow type is the same everywhere.
    if layout == "bf16":
        return _bytes_of(kv.to(torch.float32).to(torch.bfloat16))
    if layout == "f32":
        return _bytes_of(kv.to(torch.float32))
    if layout != "fp8":
        raise ValueError(f"unknown row layout {layout!r}; choose from {sorted(ROW_FORMATS)}")
    lead = kv.shape[:-1]
    latent = kv[..., :LATENT_DIM].reshape(*lead, LATENT_DIM // FP8_TILE, FP8_TILE)
    amax = latent.abs().amax(dim=-1, keepdim=True)
    # Times the reciprocal: torch divides by a Python number that way on CUDA, exactly on the CPU.
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax)).to(torch.float32)
    q = (
        (latent / scale.to(latent.dtype))
        .clamp(-FP8_MAX, FP8_MAX)
        .to(torch.float32)
        .to(torch.float8_e4m3fn)
    )
    parts = [
        _bytes_of(q.reshape(*lead, LATENT_DIM)),
        _bytes_of(scale.reshape(*lead, LATENT_DIM // FP8_TILE)),
        _bytes_of(kv[..., LATENT_DIM:].to(torch.float32).to(torch.bfloat16)),
    ]
    return torch.cat(parts, dim=-1)


def decode_rows(rows: torch.Tensor, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """[..., row_bytes] uint8 -> [..., 576] values of ``dtype`` (exact)."""
    rows = rows.contiguous()
    if layout == "bf16":
        return rows.view(torch.bfloat16).to(dtype)
    if layout == "f32":
        return rows.view(torch.float32).to(dtype)
    if layout != "fp8":
        raise ValueError(f"unknown row layout {layout!r}; choose from {sorted(ROW_FORMATS)}")
    lead = rows.shape[:-1]
    n_tiles = LATENT_DIM // FP8_TILE
    q = rows[..., :LATENT_DIM].contiguous().view(torch.float8_e4m3fn).to(dtype)
    scale = (
        rows[..., LATENT_DIM : LATENT_DIM + 4 * n_tiles].contiguous().view(torch.float32).to(dtype)
    )
    rope = rows[..., LATENT_DIM + 4 * n_tiles :].contiguous().view(torch.bfloat16).to(dtype)
    latent = (q.reshape(*lead, n_tiles, FP8_TILE) * scale.unsqueeze(-1)).reshape(*lead, LATENT_DIM)
    return torch.cat([latent, rope], dim=-1)
