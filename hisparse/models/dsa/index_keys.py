"""Byte layouts of the DSA indexer's key cache (one key per token and full layer), beside the
row layouts of ``hisparse.models.rows``.

* ``fp8`` (D + 4 B; 132 B at DeepSeek-V3.2's D = 128): D x float8_e4m3fn and one float32 scale
  per token, as DeepSeek-V3.2's reference inference quantizes the indexer keys. With HiSparse the
  key cache is most of what stays on the device per request, so its width sets capacity.
* ``f32`` (4 D B): the key as computed, for comparing with an unquantized reference.

The cache is paged: uint8 [blocks, block_size * key_bytes]. An fp8 block holds its tokens' keys
first (block_size x D bytes) and their scales after (block_size x 4), as vLLM lays out
DeepSeek-V3.2's indexer cache: every key then starts on a 16-byte boundary (block_size a multiple
of 4), which the kernel's vector loads need; 132-byte rows would not. An f32 block is its tokens'
keys in order. Decoding is exact, so a key's bytes give the same values on every device. The
default format follows the row format: fp8 keys beside fp8 rows, unquantized keys otherwise.
"""

from __future__ import annotations

import torch

from hisparse.models.rows import FP8_MAX

KEY_FORMATS = ("fp8", "f32")


def key_bytes(fmt: str, dim: int) -> int:
    """Bytes of one token's key in ``fmt`` for an index head dim of ``dim``."""
    check_format(fmt)
    if fmt == "fp8" and dim % 4:
        raise ValueError(f"fp8 index keys need index_head_dim divisible by 4, got {dim}")
    return dim + 4 if fmt == "fp8" else 4 * dim


def default_format(row_format: str) -> str:
    return "fp8" if row_format == "fp8" else "f32"


def check_format(fmt: str) -> None:
    if fmt not in KEY_FORMATS:
        raise ValueError(f"index key format must be one of {KEY_FORMATS}, got {fmt!r}")


def encode_keys(k: torch.Tensor, fmt: str) -> torch.Tensor:
    """[T, D] float -> [T, key_bytes] uint8."""
    check_format(fmt)
    k = k.to(torch.float32)
    if fmt == "f32":
        return k.contiguous().view(torch.uint8)
    amax = k.abs().amax(dim=-1, keepdim=True)
    # Times the reciprocal, not divided: torch divides by a Python number that way on CUDA and
    # exactly on the CPU, so a division would store other bytes on each (and the kernel's).
    scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
    q = (k / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q.view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=-1)


def decode_keys(b: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """[..., key_bytes] uint8 -> [..., D] float32 (exact)."""
    check_format(fmt)
    b = b.contiguous()
    if fmt == "f32":
        return b.view(torch.float32)
    q = b[..., :dim].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = b[..., dim : dim + 4].contiguous().view(torch.float32)
    return q * scale


def _byte_index(cache: torch.Tensor, slots: torch.Tensor, fmt: str, dim: int, block_size: int):
    """Flat byte offsets into the paged ``cache`` of each slot's key bytes: [*slots.shape,
    key_bytes] (an fp8 key's D value bytes, then its 4 scale bytes). Indexing the flat bytes
    touches only those rows; assigning through a strided view of the cache touched all of it."""
    if cache.dtype != torch.uint8 or cache.dim() != 2 or not cache.is_contiguous():
        raise ValueError(
            f"an index key cache is contiguous uint8 [blocks, bytes], got {cache.shape}"
        )
    kb = key_bytes(fmt, dim)
    if cache.shape[1] != block_size * kb:
        raise ValueError(
            f"an index key cache block of {block_size} {fmt} keys has {block_size * kb} bytes, "
            f"got {cache.shape[1]}"
        )
    slots = slots.long()
    base = torch.div(slots, block_size, rounding_mode="floor") * (block_size * kb)
    off = (slots % block_size).unsqueeze(-1)
    base = base.unsqueeze(-1)
    if fmt == "f32":
        return base + off * kb + torch.arange(kb, device=slots.device)
    keys = base + off * dim + torch.arange(dim, device=slots.device)
    scales = base + block_size * dim + off * 4 + torch.arange(4, device=slots.device)
    return torch.cat([keys, scales], dim=-1)


def store_keys(cache: torch.Tensor, slots, k: torch.Tensor, fmt: str, block_size: int) -> None:
    """Write keys ``k`` [T, D] (float) at ``slots`` [T] of the paged ``cache``."""
    idx = _byte_index(cache, slots, fmt, k.shape[-1], block_size)
    # index_copy_, not an indexed assignment: index_put_ took 1000x longer on a 130 MB cache
    cache.view(-1).index_copy_(0, idx.reshape(-1), encode_keys(k, fmt).reshape(-1))


def load_keys(cache: torch.Tensor, slots: torch.Tensor, fmt: str, dim: int, block_size: int):
    """Keys at ``slots`` (any shape, >= 0) of the paged ``cache`` -> float32 [*slots.shape, D]."""
    idx = _byte_index(cache, slots, fmt, dim, block_size)
    got = cache.view(-1).index_select(0, idx.reshape(-1)).view(idx.shape)
    return decode_keys(got, fmt, dim)
