"""Byte layouts of one latent KV row (what the host pool, the hot buffers and the resident cache
store), and their encoders / decoders.

A row is the MLA latent of one token in one layer: ``latent`` values (``kv_lora_rank``: 512 in
the released DeepSeek-V3.2 and GLM-5) plus ``rope`` rotary values (``qk_rope_head_dim``: 64).

* ``fp8``  (656 B at 512 + 64): float8_e4m3fn latent (tiles of 128, one float32 scale each)
  followed by bfloat16 rope values. DeepSeek-V3.2's FP8 MLA row; the latent must be whole tiles.
* ``bf16`` (1152 B): bfloat16 values (latent then rope).
* ``f32``  (2304 B): float32 values (latent then rope): no rounding past the model's own
  float32, for comparing with an unquantized reference.

A row is padded with zero bytes to a multiple of 16 B, as the gather kernels require (the
released sizes need no padding). Encoding rounds the values (that is the point of storing
bytes); decoding is exact, so two rows with the same bytes decode to the same values on any
device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse.ops.limits import ROW_ALIGN

LATENT_DIM = 512
ROPE_DIM = 64
KV_DIM = LATENT_DIM + ROPE_DIM
FP8_TILE = 128
FP8_MAX = 448.0
FORMATS = ("bf16", "f32", "fp8")


def _check_format(layout: str) -> None:
    if layout not in FORMATS:
        raise ValueError(f"unknown row layout {layout!r}; choose from {list(FORMATS)}")


def fits(layout: str, latent: int) -> bool:
    """Whether ``layout`` can hold a latent of ``latent`` values (fp8: whole tiles)."""
    _check_format(layout)
    return layout != "fp8" or latent % FP8_TILE == 0


def row_bytes(layout: str, latent: int = LATENT_DIM, rope: int = ROPE_DIM) -> int:
    """Bytes of one row of ``layout`` at these sizes, padded to ``ROW_ALIGN``."""
    if not fits(layout, latent):
        raise ValueError(f"fp8 rows need a latent of whole {FP8_TILE}-value tiles, got {latent}")
    if layout == "fp8":
        n = latent + 4 * (latent // FP8_TILE) + 2 * rope
    else:
        n = (latent + rope) * (2 if layout == "bf16" else 4)
    return -(-n // ROW_ALIGN) * ROW_ALIGN


@dataclass(frozen=True)
class RowFormat:
    name: str
    row_bytes: int


#: The formats at the released models' sizes (512 + 64).
ROW_FORMATS = {name: RowFormat(name, row_bytes(name)) for name in FORMATS}


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """[..., n] tensor -> [..., n * itemsize] uint8 (same bytes)."""
    return t.contiguous().view(torch.uint8)


def encode_rows(kv: torch.Tensor, layout: str, latent: int = LATENT_DIM) -> torch.Tensor:
    """[..., latent + rope] float -> [..., row_bytes] uint8."""
    _check_format(layout)
    rope = kv.shape[-1] - latent
    if rope < 1:
        raise ValueError(f"kv rows must have more than {latent} latent values, got {kv.shape[-1]}")
    size = row_bytes(layout, latent, rope)
    # Every narrowing goes through float32 first: a direct float64 -> fp8/bf16 conversion rounds
    # once on some devices and twice (via float32) on others, which would make CPU and CUDA
    # store different bytes. float64 -> float32 -> narrow type is the same everywhere.
    if layout == "bf16":
        return _padded(_bytes_of(kv.to(torch.float32).to(torch.bfloat16)), size)
    if layout == "f32":
        return _padded(_bytes_of(kv.to(torch.float32)), size)
    lead = kv.shape[:-1]
    tiles = latent // FP8_TILE
    part = kv[..., :latent].reshape(*lead, tiles, FP8_TILE)
    amax = part.abs().amax(dim=-1, keepdim=True)
    # Times the reciprocal: torch divides by a Python number that way on CUDA, exactly on the CPU.
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax)).to(torch.float32)
    q = (
        (part / scale.to(part.dtype))
        .clamp(-FP8_MAX, FP8_MAX)
        .to(torch.float32)
        .to(torch.float8_e4m3fn)
    )
    parts = [
        _bytes_of(q.reshape(*lead, latent)),
        _bytes_of(scale.reshape(*lead, tiles)),
        _bytes_of(kv[..., latent:].to(torch.float32).to(torch.bfloat16)),
    ]
    return _padded(torch.cat(parts, dim=-1), size)


def _padded(b: torch.Tensor, size: int) -> torch.Tensor:
    """``b`` [..., n] uint8 with zero bytes up to ``size``."""
    if b.shape[-1] == size:
        return b
    return torch.nn.functional.pad(b, (0, size - b.shape[-1]))


def decode_rows(
    rows: torch.Tensor,
    layout: str,
    dtype: torch.dtype,
    latent: int = LATENT_DIM,
    rope: int = ROPE_DIM,
) -> torch.Tensor:
    """[..., row_bytes] uint8 -> [..., latent + rope] values of ``dtype`` (exact)."""
    _check_format(layout)
    size = row_bytes(layout, latent, rope)
    if rows.shape[-1] != size:
        raise ValueError(
            f"{layout} rows of {latent} + {rope} values have {size} bytes, got {rows.shape[-1]}"
        )
    n = latent + rope
    if layout == "bf16":
        return rows[..., : 2 * n].contiguous().view(torch.bfloat16).to(dtype)
    if layout == "f32":
        return rows[..., : 4 * n].contiguous().view(torch.float32).to(dtype)
    lead = rows.shape[:-1]
    tiles = latent // FP8_TILE
    end = latent + 4 * tiles
    q = rows[..., :latent].contiguous().view(torch.float8_e4m3fn).to(dtype)
    scale = rows[..., latent:end].contiguous().view(torch.float32).to(dtype)
    pe = rows[..., end : end + 2 * rope].contiguous().view(torch.bfloat16).to(dtype)
    part = (q.reshape(*lead, tiles, FP8_TILE) * scale.unsqueeze(-1)).reshape(*lead, latent)
    return torch.cat([part, pe], dim=-1)
