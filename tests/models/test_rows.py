"""models/rows.py: the row formats are the MLA sizes (other latent sizes pad to 16 B),
decoding is exact (re-encoding a decoded row gives its bytes back), an all-zero FP8 tile encodes
without dividing by zero, and every narrowing goes through float32 (so a float64 value rounds as
its float32 value does, on any device)."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.rows import KV_DIM, ROW_FORMATS, decode_rows, encode_rows, fits, row_bytes


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


@pytest.mark.parametrize(
    "latent, rope, sizes",
    [
        (512, 64, {"fp8": 656, "bf16": 1152, "f32": 2304}),  # the released models: no padding
        (256, 32, {"fp8": 336, "bf16": 576, "f32": 1152}),  # fp8: 328 B of values
        (42, 8, {"bf16": 112, "f32": 208}),  # 100 and 200 B of values; fp8 needs whole tiles
    ],
)
def test_other_latent_sizes_pad_to_16_bytes_and_round_trip(latent, rope, sizes):
    x = torch.randn(
        4, latent + rope, dtype=torch.float64, generator=torch.Generator().manual_seed(9)
    )
    for name in ROW_FORMATS:
        if name not in sizes:
            assert not fits(name, latent)
            with pytest.raises(ValueError, match="whole 128-value tiles"):
                encode_rows(x, name, latent)
            continue
        assert row_bytes(name, latent, rope) == sizes[name]
        b = encode_rows(x, name, latent)
        assert b.shape == (4, sizes[name])
        values = {"fp8": latent + latent // 32 + 2 * rope, "bf16": 2 * (latent + rope)}
        used = values.get(name, 4 * (latent + rope))
        assert not b[:, used:].any()  # the padding is zero bytes
        y = decode_rows(b, name, torch.float64, latent, rope)
        assert y.shape == x.shape and torch.equal(encode_rows(y, name, latent), b)
        rel = (y - x).abs().max() / x.abs().max()
        assert rel < {"fp8": 0.07, "bf16": 0.01, "f32": 1e-6}[name]
        with pytest.raises(ValueError, match=f"have {sizes[name]} bytes"):
            decode_rows(b[:, :-16], name, torch.float64, latent, rope)
