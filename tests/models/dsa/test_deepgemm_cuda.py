"""DeepGEMM's paged logits as the indexer's scores on a GPU (marked ``cuda``; skipped where no
DeepGEMM is importable, e.g. benchmarks/baselines/build_deepgemm.sh not run): equal to a float64
reference of the same FP8 query, masked as the Triton kernel masks and close to its scores,
replayed from a CUDA graph as run eagerly, both residency modes bit-identical through it, and the
choice measured and said."""

from __future__ import annotations

import logging

import pytest
import torch

from hisparse.models.dsa import index_keys
from hisparse.models.dsa.kernels import deepgemm
from hisparse.models.dsa.kernels import indexer as idx_kernel
from tests.devices import needs_cuda

pytestmark = [
    pytest.mark.cuda,
    needs_cuda,
    pytest.mark.skipif(deepgemm.find() is None, reason="no DeepGEMM importable"),
]
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


def test_scores_equal_a_float64_reference_of_the_fp8_query():
    q, hw, cache, bt, req, pos = _batch()
    got = deepgemm.find()(q, hw, cache, bt, BS, req, pos)
    q8, w = deepgemm.quantize_queries(q, hw)
    for t in range(5):
        n = int(pos[t]) + 1
        j = torch.arange(n, device=GPU)
        k = index_keys.load_keys(cache, bt[req[t], j // BS].long() * BS + j % BS, "fp8", D, BS)
        want = (w[t, :, None].double() * torch.relu(q8[t].double() @ k.double().T)).sum(0)
        gap = (got[t, :n].double() - want).abs().max() / want.abs().max()
        assert gap < 2e-3, f"token {t}: {gap}"
        assert torch.isinf(got[t, n:]).all() and (got[t, n:] < 0).all(), "masked past pos"


def test_masked_as_the_triton_kernel_and_close_to_it():
    q, hw, cache, bt, req, pos = _batch(seed=1)
    args = (q, hw, cache, bt, BS, req, pos)
    got, ours = deepgemm.find()(*args), idx_kernel.paged_scores(*args)
    assert got.shape == ours.shape and torch.equal(torch.isinf(got), torch.isinf(ours))
    seen = torch.isfinite(ours)
    gap = (got[seen] - ours[seen]).abs().max() / ours[seen].abs().max()
    assert gap < deepgemm.AGREE, f"an FP8 query's rounding, not more: {gap}"


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


def test_both_modes_give_the_same_bits_through_it():
    from hisparse.engine.graph import CoreStep, GraphConfig

    cfg = GraphConfig.tiny(hidden=128, heads=16, idx_heads=64, idx_dim=128, top_k=64, hot_size=128)
    step = CoreStep(cfg, 4, device="cuda", indexer="deepgemm")
    assert step.core.indexer == "deepgemm"
    for _ in range(3):
        step.stage()
        res, hs = step.forward("resident"), step.forward("hisparse")
        assert torch.equal(res[0], hs[0]) and torch.equal(res[1], hs[1])


def test_the_choice_is_measured_and_said(monkeypatch, caplog):
    monkeypatch.setattr(deepgemm, "_CHOICE", {})
    with caplog.at_level(logging.INFO, logger="hisparse"):
        got = deepgemm.choose(GPU, H, D, idx_kernel.paged_scores)
    said = [r.getMessage() for r in caplog.records if "indexer scores" in r.getMessage()]
    assert got in ("deepgemm", "triton") and len(said) == 1
    assert "against the Triton kernel" in said[0] and "keys" in said[0], said
