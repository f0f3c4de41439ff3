"""DeepGEMM's paged logits as the indexer's scores on a GPU (marked ``cuda``; those calling it
skipped where no DeepGEMM is importable, e.g. benchmarks/baselines/build_deepgemm.sh not run):
equal to a float64 reference of the same FP8 query, masked as the Triton kernel masks and close
to its scores, replayed from a CUDA graph as run eagerly, both residency modes bit-identical
through it, and the choice measured and said. Without DeepGEMM too: the one-launch inputs and
mask around it (``fp8_queries``) give torch's bits."""

from __future__ import annotations

import logging

import pytest
import torch

from hisparse.models.dsa import index_keys
from hisparse.models.dsa.kernels import deepgemm, fp8_queries
from hisparse.models.dsa.kernels import indexer as idx_kernel
from tests.devices import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]
needs_deepgemm = pytest.mark.skipif(deepgemm.find() is None, reason="no DeepGEMM importable")
needs_triton = pytest.mark.skipif(fp8_queries.triton is None, reason="needs Triton")
GPU = torch.device("cuda")
H, D, BS = 64, 128, deepgemm.BLOCK


def _batch(keys=8192, seed=0):
    """Three requests of ``keys`` keys in shuffled blocks; five tokens: request 1 twice (an MTP
    verify step), ragged positions (one inside the first block)."""
    g = torch.Generator(device=GPU).manual_seed(seed)
    per = keys // BS
    blocks = 3 * per
    cache = torch.empty(blocks, BS * (D + 4), dtype=torch.uint8, device=GPU)
    slots = torch.arange(blocks * BS, device=GPU)
    keys_f = torch.randn(blocks * BS, D, device=GPU, generator=g)
    idx_kernel.store_fp8_keys(cache, slots, keys_f, BS)
    bt = torch.randperm(blocks, device=GPU, generator=g).to(torch.int32).view(3, per)
    req = torch.tensor([0, 1, 1, 2, 0], device=GPU)
    pos = torch.tensor([keys - 1, 5000, 5001, 17, 4095], device=GPU)
    q = torch.randn(5, H, D, device=GPU, generator=g).bfloat16()
    hw = torch.rand(5, H, device=GPU, generator=g) * (H * D) ** -0.5
    return q, hw, cache, bt, req, pos


@needs_deepgemm
def test_scores_equal_a_float64_reference_of_the_fp8_query():
    q, hw, cache, bt, req, pos = _batch()
    got = deepgemm.find()(q, hw, cache, bt, BS, req, pos)
    q8, w = fp8_queries.quantize_queries(q, hw)
    for t in range(5):
        n = int(pos[t]) + 1
        j = torch.arange(n, device=GPU)
        k = index_keys.load_keys(cache, bt[req[t], j // BS].long() * BS + j % BS, "fp8", D, BS)
        want = (w[t, :, None].double() * torch.relu(q8[t].double() @ k.double().T)).sum(0)
        gap = (got[t, :n].double() - want).abs().max() / want.abs().max()
        assert gap < 2e-3, f"token {t}: {gap}"
        assert torch.isinf(got[t, n:]).all() and (got[t, n:] < 0).all(), "masked past pos"


@needs_deepgemm
def test_masked_as_the_triton_kernel_and_close_to_it():
    q, hw, cache, bt, req, pos = _batch(seed=1)
    args = (q, hw, cache, bt, BS, req, pos)
    got, ours = deepgemm.find()(*args), idx_kernel.paged_scores(*args)
    assert got.shape == ours.shape and torch.equal(torch.isinf(got), torch.isinf(ours))
    seen = torch.isfinite(ours)
    gap = (got[seen] - ours[seen]).abs().max() / ours[seen].abs().max()
    assert gap < deepgemm.AGREE, f"an FP8 query's rounding, not more: {gap}"


@needs_deepgemm
def test_a_replay_gives_the_eager_bits():
    q, hw, cache, bt, req, pos = _batch(seed=2)
    fn = deepgemm.find()
    eager = fn(q, hw, cache, bt, BS, req, pos).clone()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(q, hw, cache, bt, BS, req, pos)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(q, hw, cache, bt, BS, req, pos)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


@needs_deepgemm
def test_both_modes_give_the_same_bits_through_it():
    from hisparse.engine.graph import CoreStep, GraphConfig

    cfg = GraphConfig.tiny(hidden=128, heads=16, idx_heads=64, idx_dim=128, top_k=64, hot_size=128)
    step = CoreStep(cfg, 4, device="cuda", indexer="deepgemm")
    assert step.core.indexer == "deepgemm"
    for _ in range(3):
        step.stage()
        res, hs = step.forward("resident"), step.forward("hisparse")
        assert torch.equal(res[0], hs[0]) and torch.equal(res[1], hs[1])


@needs_deepgemm
def test_the_choice_is_measured_and_said(monkeypatch, caplog):
    monkeypatch.setattr(deepgemm, "_CHOICE", {})
    with caplog.at_level(logging.INFO, logger="hisparse"):
        got = deepgemm.choose(GPU, H, D, idx_kernel.paged_scores)
    said = [r.getMessage() for r in caplog.records if "indexer scores" in r.getMessage()]
    assert got in ("deepgemm", "triton") and len(said) == 1
    assert "against the Triton kernel" in said[0] and "keys" in said[0], said


@needs_triton
@pytest.mark.parametrize("T", [1, 7, 64])
def test_the_fused_inputs_are_torchs_bits(T):
    g = torch.Generator(device=GPU).manual_seed(T)
    span = torch.logspace(-4, 4, T, device=GPU)[:, None, None]  # amax from 1e-4 to 1e4
    full = (torch.randn(T, H, D + 64, device=GPU, generator=g) * span).bfloat16()
    full[0, 3] = 0.0  # an all-zero head: scale 1
    hw = torch.rand(T, H, device=GPU, generator=g) * (H * D) ** -0.5
    table = torch.randperm(9 * 40, device=GPU, generator=g).view(9, 40)
    req = torch.randint(0, 9, (T,), device=GPU, generator=g)
    pos = torch.randint(0, 40 * BS, (T,), device=GPU, generator=g)  # ragged
    # strided query rows (a slice of a wider projection) and a contiguous copy; both table types
    for q, bt in ((full[..., :D], table), (full[..., :D].contiguous(), table.int())):
        got = fp8_queries.prepare(q, hw, bt, req, pos)
        want = fp8_queries.prepare_torch(q, hw, bt, req, pos)
        for name, a, b in zip(("q8", "w", "lens", "bt"), got, want):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            if name == "q8":
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a, b), f"{name}: {int((a != b).sum())} of {a.numel()} differ"
        assert torch.equal(got[1][0, 3], hw[0, 3]), "an all-zero head keeps scale 1"


@needs_triton
@pytest.mark.parametrize("T", [1, 7, 64])
def test_the_fused_mask_is_masked_fill(T):
    g = torch.Generator(device=GPU).manual_seed(100 + T)
    L = 16384
    out = torch.randn(T, L + 96, device=GPU, generator=g)[:, :L]  # rows strided, as if padded
    pos = torch.randint(0, L + 64, (T,), device=GPU, generator=g)  # some past the row's end
    pos[0] = 0
    want = fp8_queries.mask_past_torch(out.clone(), pos)
    assert fp8_queries.mask_past(out, pos) is out
    assert torch.equal(out, want)
