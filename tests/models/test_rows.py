"""models/rows.py: the row formats are the MLA sizes, decoding is exact (re-encoding a decoded row
gives its bytes back), an all-zero FP8 tile encodes without dividing by zero, and every
narrowing goes through float32 (so a float64 value rounds as its float32 value does, on any
device)."""

from __future__ import annotations

import torch

from hisparse.models.rows import KV_DIM, ROW_FORMATS, decode_rows, encode_rows


def test_row_formats_are_the_mla_sizes_and_round_trip():
    sizes = {name: f.row_bytes for name, f in ROW_FORMATS.items()}
    assert sizes == {"fp8": 656, "bf16": 1152, "f32": 2304}
    x = torch.randn(5, 7, KV_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[0, 0, :128] = 0.0  # an all-zero FP8 tile must not divide by zero
    for name, fmt in ROW_FORMATS.items():
        b = encode_rows(x, name)
        assert b.dtype == torch.uint8 and b.shape == (5, 7, fmt.row_bytes)
        assert fmt.row_bytes % 16 == 0  # the gather kernels' alignment
        y = decode_rows(b, name, torch.float64)
        assert torch.isfinite(y).all()
        assert torch.equal(encode_rows(y, name), b)  # decoding is exact: re-encoding is a fixpoint
        rel = (y - x).abs().max() / x.abs().max()
        assert rel < {"fp8": 0.07, "bf16": 0.01, "f32": 1e-6}[name]


def test_encoding_depends_only_on_the_float32_value():
    # A float64 value just past a float32-representable fp8 midpoint still encodes like that
    # midpoint: the encoder narrows through float32, as every device does.
    x = torch.randn(3, KV_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x[:, 1] = 1.0625 + 2.0**-30  # fp8 e4m3 midpoint between 1.0 and 1.125, plus a float64 hair
    x[:, 0] = 448.0  # keep the tile's scale at exactly 1.0
    x32 = x.to(torch.float32).to(torch.float64)
    assert torch.equal(encode_rows(x, "bf16"), encode_rows(x32, "bf16"))
    # fp8: tile 0 has scale 1.0 in both (other tiles' scales follow their own amax)
    a, b = encode_rows(x, "fp8"), encode_rows(x32, "fp8")
    assert torch.equal(a[:, :128], b[:, :128])
    assert a[0, 1].item() == 0x38  # 1.0 (ties to even after the float32 step), not 1.125
