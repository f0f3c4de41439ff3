"""More than 64 member layers in one gather / save_rows call (issue 23, item 12). docs/ops.md:
any number of layers per call on both backends; the CUDA backend issues one launch per 64 layers.
Layer counts on both sides of each launch boundary, a different row size per layer (so a launch
boundary falls between layers of different sizes), token-major strided host views (the
connector's pool layout), out-of-range entries and clamped miss counts. The CUDA backend must
match the CPU backend byte for byte and in moved bytes; the CPU backend is checked against the
oracle here too, so the cases themselves run on every machine."""

from __future__ import annotations

import pytest
import torch

from hisparse import ops
from tests import oracle
from tests.devices import CUDA_REASON, cuda_ready

I32 = torch.int32
LAYER_COUNTS = [64, 65, 128, 129, 200]
ROW_SIZES = (16, 48, 32, 656)  # bytes, cycled over the layers
ROWS, HOT_ROWS = 96, 160
needs_gpu = [pytest.mark.cuda, pytest.mark.skipif(not cuda_ready(), reason=CUDA_REASON)]


def _sizes(L):
    return [ROW_SIZES[l % len(ROW_SIZES)] for l in range(L)]


def _host_pool(L, g, pin):
    """Token-major pool: host row k of every layer side by side; layer l a strided view."""
    sizes = _sizes(L)
    raw = torch.randint(0, 256, (ROWS, sum(sizes)), generator=g, dtype=torch.uint8)
    raw = raw.pin_memory() if pin else raw
    offs = [sum(sizes[:l]) for l in range(L)]
    return raw, [raw[:, o : o + rb] for o, rb in zip(offs, sizes)]


def _plan(g, K=40):
    """B=4 rows: in-range and out-of-range sources and destinations, counts past K and < 0."""
    src = torch.randint(-2, ROWS + 3, (4, K), generator=g, dtype=torch.int64).to(I32)
    dst = torch.randperm(HOT_ROWS + 40, generator=g)[: 4 * K].view(4, K).to(I32) - 20
    count = torch.tensor([K + 7, 0, 17, -3], dtype=I32)
    return src, dst, count


def _gather(L, device, seed=7):
    g = torch.Generator().manual_seed(seed + L)
    _, host = _host_pool(L, g, pin=device != "cpu")
    src, dst, count = _plan(g)
    hot = [torch.zeros(HOT_ROWS, rb, dtype=torch.uint8, device=device) for rb in _sizes(L)]
    moved = torch.full((1,), 3, dtype=torch.uint64, device=device)
    ops.gather(host, hot, src.to(device), dst.to(device), count.to(device), moved)
    if device != "cpu":
        torch.cuda.synchronize()
    return host, (src, dst, count), [h.cpu() for h in hot], int(moved.cpu()[0])


def _save(L, device, seed=11):
    g = torch.Generator().manual_seed(seed + L)
    raw, host = _host_pool(L, g, pin=device != "cpu")
    before = raw.clone()
    src = [
        torch.randint(0, 256, (50, rb), generator=g, dtype=torch.uint8).to(device)
        for rb in _sizes(L)
    ]
    n = 30
    src_rows = torch.randint(-2, 53, (n,), generator=g, dtype=torch.int64).to(I32)
    host_rows = (torch.randperm(ROWS + 6, generator=g)[:n] - 3).to(I32)  # distinct
    moved = torch.zeros(1, dtype=torch.uint64, device=device)
    ops.save_rows(src, host, src_rows.to(device), host_rows.to(device), moved)
    if device != "cpu":
        torch.cuda.synchronize()
    return before, [s.cpu() for s in src], (src_rows, host_rows), raw.clone(), int(moved.cpu()[0])


def _rows(t):
    return [bytes(r) for r in t.tolist()]


@pytest.mark.parametrize("L", LAYER_COUNTS)
def test_cpu_gather_of_many_layers_matches_the_oracle(L):
    host, (src, dst, count), hot, moved = _gather(L, "cpu")
    expected = 3
    for l, rb in enumerate(_sizes(L)):
        want = [bytes(rb)] * HOT_ROWS
        expected += oracle.gather(_rows(host[l]), want, src.tolist(), dst.tolist(), count.tolist())
        assert _rows(hot[l]) == want, f"layer {l}"
    assert moved == expected


@pytest.mark.parametrize("L", LAYER_COUNTS)
def test_cpu_save_rows_of_many_layers_matches_the_oracle(L):
    before, src, (src_rows, host_rows), after, moved = _save(L, "cpu")
    sizes, expected, off = _sizes(L), 0, 0
    for l, rb in enumerate(sizes):
        want = _rows(before[:, off : off + rb])
        expected += oracle.save_rows(_rows(src[l]), want, src_rows.tolist(), host_rows.tolist())
        assert _rows(after[:, off : off + rb]) == want, f"layer {l}"
        off += rb
    assert moved == expected


@pytest.mark.parametrize("L", LAYER_COUNTS)
@pytest.mark.parametrize("op", ["gather", "save_rows"])
@pytest.mark.parametrize("_", [pytest.param(0, marks=needs_gpu)], ids=["cuda"])
def test_cuda_many_layers_match_the_cpu_backend(L, op, _):
    """The CUDA backend splits the call into launches of 64 layers; every layer, on either side
    of a launch boundary, must come out as the CPU backend's, and moved bytes must agree."""
    run = _gather if op == "gather" else _save
    cpu, gpu = run(L, "cpu"), run(L, "cuda")
    got_cpu, got_gpu = cpu[-2], gpu[-2]
    if op == "gather":
        for l in range(L):
            assert torch.equal(got_cpu[l], got_gpu[l]), f"layer {l} of {L}"
    else:
        assert torch.equal(got_cpu, got_gpu), f"{L} layers"
    assert cpu[-1] == gpu[-1]
