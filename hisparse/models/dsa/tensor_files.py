"""safetensors files read strictly and written without numpy: every header field is checked
against the file before a byte of tensor data is read, so a truncated or corrupt file fails in
one line naming the file and the tensor (not ``OverflowError`` from a seek, ``MemoryError``
from a header length, or a reshape error naming neither).

The format: an 8-byte little-endian header length, a JSON header mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data after the header),
then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Tuple, Union

import torch

DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
}
_NAMES = {t: n for n, t in DTYPES.items()}
# The safetensors library's own bound: a larger length is corruption, not a header.
MAX_HEADER = 100 * 2**20


class CheckpointError(ValueError):
    """The directory is not a readable DSA checkpoint (the message names what is wrong)."""


@dataclass(frozen=True)
class Entry:
    """One tensor's header entry, checked against the file: ``begin``/``end`` are absolute."""

    path: Path
    name: str
    dtype: str
    shape: Tuple[int, ...]
    begin: int
    end: int

    def where(self) -> str:
        return f"{self.path}: tensor {self.name!r}"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _entry(path: Path, name: str, info, data_start: int, data_len: int) -> Entry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where}: header entry is {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPES:
        raise CheckpointError(
            f"{where} is {dtype}; only unquantized checkpoints (F32, F16, BF16, F64) and "
            "block-FP8 ones (F8_E4M3 with weight_scale_inv) are read"
        )
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} are not [begin, end]")
    if offsets[1] > data_len:
        raise CheckpointError(
            f"{where}: data_offsets {offsets} run past the {data_len} data bytes the file "
            "holds (truncated file or corrupt header)"
        )
    want = DTYPES[dtype].itemsize
    for s in shape:
        want *= s
    if want != offsets[1] - offsets[0]:
        raise CheckpointError(
            f"{where}: shape {shape} x {dtype} is {want} bytes but data_offsets {offsets} span "
            f"{offsets[1] - offsets[0]}"
        )
    begin = data_start + offsets[0]
    return Entry(path, name, dtype, tuple(shape), begin, data_start + offsets[1])


def read_header(path: Union[str, Path]) -> Dict[str, Entry]:
    """Every tensor entry of one file, checked against the file's size; no data is read."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if n is None:
                raise CheckpointError(
                    f"{path} is not a safetensors file ({size} bytes, shorter than the 8-byte "
                    "header length)"
                )
            if n > size - 8:
                raise CheckpointError(
                    f"{path}: header length {n} runs past the end of the file ({size} bytes): "
                    "truncated, or not a safetensors file"
                )
            if n > MAX_HEADER:
                raise CheckpointError(
                    f"{path}: header length {n} is over safetensors' {MAX_HEADER}-byte limit "
                    "(corrupt, or not a safetensors file)"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    data_len = size - 8 - n
    return {
        name: _entry(path, name, info, 8 + n, data_len)
        for name, info in header.items()
        if name != "__metadata__"
    }


def read_tensor(f, entry: Entry) -> torch.Tensor:
    """``entry``'s tensor (its stored dtype) from the open file ``f`` (checked by read_header)."""
    f.seek(entry.begin)
    raw = bytearray(f.read(entry.end - entry.begin))
    if len(raw) != entry.end - entry.begin:  # the file shrank after its header was read
        raise CheckpointError(f"{entry.where()}: the file ends inside the tensor's data")
    dtype = DTYPES[entry.dtype]
    t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return t.reshape(entry.shape)
