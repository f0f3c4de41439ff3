"""A corrupt or mismatched DSA checkpoint fails to load in one line naming the file and the
tensor, before any tensor data is read: handcrafted safetensors files (truncated, bad header
length, header garbage, offsets out of range, unknown dtype, shape x dtype != byte span, a shape
config.json does not give, shards that clash or are missing)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from hisparse.models.dsa import tensor_files, weights
from hisparse.models.dsa.random_checkpoint import write_random_checkpoint
from hisparse.models.dsa.tensor_files import read_header
from hisparse.models.dsa.weights import CheckpointError, load_checkpoint

CPU = torch.device("cpu")
KV_B = "model.layers.0.self_attn.kv_b_proj.weight"


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_random_checkpoint(tmp_path / "ck", "deepseek_v32", seed=5)


def _split(path: Path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(path: Path, header, data: bytes) -> None:
    head = json.dumps(header).encode() if not isinstance(header, bytes) else header
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def _edit(ckpt: Path, edit) -> Path:
    f = ckpt / "model.safetensors"
    header, data = _split(f)
    edit(header)
    _join(f, header, data)
    return f


def _fails(ckpt: Path, *words: str, monkeypatch=None) -> str:
    if monkeypatch is not None:  # no tensor data may be read before the error

        def no_read(*a, **k):
            raise AssertionError("tensor data read before the headers were checked")

        monkeypatch.setattr(weights, "read_tensor", no_read)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(ckpt, CPU)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_a_truncated_file_names_the_file_and_the_first_tensor_past_its_end(ckpt, monkeypatch):
    f = ckpt / "model.safetensors"
    header, data = _split(f)
    _join(f, header, data[: len(data) // 2])
    cut = len(data) // 2
    past = [n for n, v in header.items() if n != "__metadata__" and v["data_offsets"][1] > cut]
    msg = _fails(ckpt, str(f), "run past the", "truncated", monkeypatch=monkeypatch)
    assert any(repr(n) in msg for n in past)


def test_a_file_shorter_than_its_header_length_field(ckpt):
    f = ckpt / "model.safetensors"
    f.write_bytes(b"\x10\x00\x00")
    _fails(ckpt, str(f), "shorter than the 8-byte header length")


@pytest.mark.parametrize("n", [2**63 + 5, 2**40, 10**8])
def test_a_header_length_past_the_file_is_refused_without_reading_it(ckpt, n):
    f = ckpt / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", n) + raw[8:])
    _fails(ckpt, str(f), f"header length {n} runs past the end of the file")


def test_a_header_length_over_the_format_limit(ckpt, monkeypatch):
    """safetensors caps headers at 100 MiB; a longer one is corruption even in a large file."""
    monkeypatch.setattr(tensor_files, "MAX_HEADER", 64)
    _fails(ckpt, str(ckpt / "model.safetensors"), "over safetensors' 64-byte limit")


@pytest.mark.parametrize(
    "garbage, words",
    [
        (b"{not json at all", "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (b"[1, 2, 3]", "not a JSON object"),
    ],
)
def test_header_garbage_names_the_file(ckpt, garbage, words):
    f = ckpt / "model.safetensors"
    _, data = _split(f)
    _join(f, garbage, data)
    _fails(ckpt, str(f), words)


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("dtype", "F8_E5M2", "is F8_E5M2; only unquantized checkpoints"),
        ("dtype", "I8", "is I8; only unquantized checkpoints"),
        ("dtype", None, "is None; only unquantized checkpoints"),
        ("shape", [576, -1], "is not a list of sizes"),
        ("shape", "576x512", "is not a list of sizes"),
        ("data_offsets", [5], "are not [begin, end]"),
        ("data_offsets", [100, 4], "are not [begin, end]"),
        ("data_offsets", [True, 4], "are not [begin, end]"),
        ("data_offsets", [0, 2**70], "run past the"),
        ("data_offsets", [2**64, 2**64 + 4], "run past the"),
    ],
)
def test_a_bad_header_entry_names_file_and_tensor(ckpt, field, value, words, monkeypatch):
    f = _edit(ckpt, lambda h: h[KV_B].__setitem__(field, value))
    _fails(ckpt, str(f), repr(KV_B), words, monkeypatch=monkeypatch)


def test_an_entry_that_is_not_an_object(ckpt):
    f = _edit(ckpt, lambda h: h.__setitem__(KV_B, [1, 2]))
    _fails(ckpt, str(f), repr(KV_B), "header entry is list")


def test_shape_times_dtype_not_the_byte_span(ckpt, monkeypatch):
    """The case that used to be 'shape [576, 128] is invalid for input of size ...'."""
    f = _edit(ckpt, lambda h: h[KV_B].__setitem__("shape", [256, 511]))
    _fails(ckpt, str(f), repr(KV_B), "[256, 511] x F32 is 523264 bytes", monkeypatch=monkeypatch)


def test_a_shape_config_json_does_not_give_is_refused_before_any_data(ckpt, monkeypatch):
    """A well-formed file of another model: the header's shape against config.json."""
    f = _edit(ckpt, lambda h: h[KV_B].__setitem__("shape", [512, 256]))
    msg = _fails(ckpt, str(f), repr(KV_B), "has shape [512, 256]", monkeypatch=monkeypatch)
    assert "config.json makes it [256, 512]" in msg


def test_a_vector_of_the_wrong_length(ckpt):
    name = "model.layers.1.mlp.gate.e_score_correction_bias"

    def halve(h):
        n, lo = h[name]["shape"][0], h[name]["data_offsets"][0]
        h[name].update(shape=[n // 2], data_offsets=[lo, lo + n // 2 * 4])

    _edit(ckpt, halve)
    _fails(ckpt, repr(name), "has shape [4]; config.json makes it [8]")


def _shard(ckpt: Path, dup: bool = False) -> tuple:
    """Split model.safetensors into two shards with an index; ``dup``: KV_B in both."""
    f = ckpt / "model.safetensors"
    header, data = _split(f)
    meta = header.pop("__metadata__", None)
    names = list(header)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    if dup:
        (halves[1] if KV_B in halves[0] else halves[0]).append(KV_B)
    files = []
    for i, part in enumerate(halves):
        out, blob = {}, b""
        for n in part:
            lo, hi = header[n]["data_offsets"]
            out[n] = {**header[n], "data_offsets": [len(blob), len(blob) + hi - lo]}
            blob += data[lo:hi]
        out["__metadata__"] = meta
        path = ckpt / f"model-0000{i + 1}-of-00002.safetensors"
        _join(path, out, blob)
        files.append(path)
    f.unlink()
    weight_map = {n: p.name for p, part in zip(files, halves) for n in part}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return files


def test_sharded_checkpoints_load_and_name_the_shard(ckpt):
    ref = load_checkpoint(ckpt, CPU)
    files = _shard(ckpt)
    got = load_checkpoint(ckpt, CPU)
    assert torch.equal(ref.attn[0]["kv_b_proj.weight"], got.attn[0]["kv_b_proj.weight"])
    shard = next(p for p in files if KV_B in read_header(p))
    header, data = _split(shard)
    header[KV_B]["shape"] = [1, 2]
    _join(shard, header, data)
    _fails(ckpt, str(shard), repr(KV_B))


def test_a_tensor_in_two_shards(ckpt):
    _shard(ckpt, dup=True)
    _fails(ckpt, repr(KV_B), "is also in")


def test_an_index_naming_a_missing_shard(ckpt):
    files = _shard(ckpt)
    files[1].unlink()
    _fails(ckpt, "model.safetensors.index.json", files[1].name)


def test_an_index_that_is_garbage(ckpt):
    _shard(ckpt)
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": 5}')
    _fails(ckpt, "model.safetensors.index.json", "is not a safetensors index")
