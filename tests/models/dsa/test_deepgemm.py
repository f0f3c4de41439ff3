"""DeepGEMM as the indexer's scores, without a GPU: the adapter's plumbing against a stand-in
that computes DeepGEMM's documented contract in torch (and leaves garbage past each context, as
the kernel may), the query quantization, sources in order, the refusals and the log line when
none is importable, and the choice by the probe times summed over its shapes. The CUDA half,
the real kernel against the Triton one and in the core and the fused inputs and mask against
torch's, is test_deepgemm_cuda.py; the fused kernels under the interpreter are
tests/engine/triton_interpreted.py's."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from hisparse.models.dsa import index_keys
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.kernels import deepgemm, fp8_queries

BLOCK, HEADS, DIM = 4, 8, 16


def _fake_module(name: str = "deep_gemm", legacy: bool = True):
    """DeepGEMM's paged logits in torch: q [B, 1, H, D] fp8, kv [blocks, bs, 1, D + 4] uint8
    (a block's keys, then its scales), weights [B, H], lens [B, 1], block table [B, max]."""
    m = types.ModuleType(name)
    m.calls = []

    def meta(lens, block_kv, num_sms):
        assert lens.dtype == torch.int32 and lens.dim() == 2 and lens.shape[1] == 1
        m.calls.append(("meta", block_kv, num_sms))
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def logits(q, kv, w, lens, bt, schedule, max_len):
        assert q.dtype == torch.float8_e4m3fn and bt.dtype == torch.int32
        B, _, H, D = q.shape
        bs = kv.shape[1]
        flat = kv.reshape(kv.shape[0], -1)
        out = torch.full((B, max_len), 12345.0)  # garbage where the kernel writes nothing
        for b in range(B):
            n = int(lens[b, 0])
            slots = bt[b, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
            k = index_keys.load_keys(flat, slots, "fp8", D, bs)
            s = torch.relu(q[b, 0].float() @ k.T)  # [H, n]
            out[b, :n] = (w[b, :, None] * s).sum(0)
        m.calls.append(("logits", B, max_len))
        return out

    m.get_paged_mqa_logits_metadata = meta
    m.get_num_sms = lambda: 7
    if legacy:  # the older API: the values, and clean_logits last

        def old(q, kv, w, lens, bt, schedule, max_len, clean_logits):
            assert clean_logits is False
            return logits(q, kv, w, lens, bt, schedule, max_len)

        m.fp8_paged_mqa_logits = old
    else:  # the newer one (vLLM 0.33's): (values, scales), no clean_logits
        m.fp8_fp4_paged_mqa_logits = lambda q, *a: logits(q[0], *a) if q[1] is None else None
    return m


@pytest.fixture
def sources(monkeypatch):
    monkeypatch.setattr(deepgemm, "_SOURCES", list(deepgemm._SOURCES))
    monkeypatch.setattr(deepgemm, "_CHOICE", {})
    for name in deepgemm._SOURCES:
        monkeypatch.setitem(sys.modules, name, None)  # not importable unless a test says so
    return monkeypatch


def _batch(seed=0):
    """Three requests' keys in a paged cache, four tokens (request 1 twice, as an MTP verify
    step), positions short of the last block's end."""
    g = torch.Generator().manual_seed(seed)
    blocks = 9
    cache = torch.zeros(blocks, BLOCK * (DIM + 4), dtype=torch.uint8)
    keys = torch.randn(blocks * BLOCK, DIM, generator=g)
    index_keys.store_keys(cache, torch.arange(blocks * BLOCK), keys, "fp8", BLOCK)
    bt = torch.tensor([[2, 0, 5], [1, 4, 3], [8, 7, 6]], dtype=torch.int32)
    req = torch.tensor([0, 1, 1, 2])
    pos = torch.tensor([9, 6, 7, 0])
    q = torch.randn(4, HEADS, DIM, generator=g).bfloat16()
    hw = torch.rand(4, HEADS, generator=g)
    return q, hw, cache, bt, req, pos


def _reference(q, hw, cache, bt, req, pos):
    """float64 scores of the unquantized queries, -inf past each position."""
    L = bt.shape[1] * BLOCK
    out = torch.full((len(req), L), float("-inf"), dtype=torch.float64)
    for t in range(len(req)):
        n = int(pos[t]) + 1
        slots = bt[req[t], torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
        k = index_keys.load_keys(cache, slots, "fp8", DIM, BLOCK).double()
        out[t, :n] = (hw[t, :, None].double() * torch.relu(q[t].double() @ k.T)).sum(0)
    return out


@pytest.mark.parametrize("legacy", [True, False])
def test_scores_follow_the_paged_contract(legacy):
    q, hw, cache, bt, req, pos = _batch()
    mod = _fake_module(legacy=legacy)
    got = deepgemm.DeepGEMMScores(mod)(q, hw, cache, bt, BLOCK, req, pos)
    want = _reference(q, hw, cache, bt, req, pos)
    assert got.dtype == torch.float32 and got.shape == want.shape == (4, 3 * BLOCK)
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "masked past each position"
    seen = torch.isfinite(want)
    gap = (got[seen].double() - want[seen]).abs().max() / want[seen].abs().max()
    assert gap < 0.02, f"an fp8 query's rounding, not more: {gap}"
    assert ("meta", BLOCK, 7) in mod.calls and ("logits", 4, 3 * BLOCK) in mod.calls


def test_queries_quantize_per_token_and_head_into_the_weights():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, HEADS, DIM, generator=g) * torch.tensor([1e-3, 1.0, 1e3]).view(3, 1, 1)
    q[0, 0] = 0.0  # an all-zero head keeps scale 1, no division by zero
    hw = torch.rand(3, HEADS, generator=g)
    q8, w = fp8_queries.quantize_queries(q, hw)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == q.shape
    scale = w / hw
    assert scale[0, 0] == 1.0
    assert q8.float().abs().amax(-1)[1:].eq(448.0).all(), "each head spans fp8's range"
    back = q8.float() * scale[..., None]
    assert ((back - q).abs() <= q.abs().amax(-1, keepdim=True) / 8).all()


def test_sources_are_tried_in_order(sources):
    assert deepgemm.find() is None
    sources.setitem(sys.modules, "vllm.third_party.deep_gemm", _fake_module("vendored"))
    assert deepgemm.find().name == "vendored"
    sources.setitem(sys.modules, "deep_gemm", _fake_module("deep_gemm"))
    assert deepgemm.find().name == "deep_gemm", "the installed package comes first, as vLLM's"
    sources.setitem(sys.modules, "deep_gemm", types.ModuleType("deep_gemm"))  # lacks the API
    assert deepgemm.find().name == "vendored"


def test_without_deepgemm_the_triton_kernel_is_said_once(sources, caplog):
    with caplog.at_level(logging.INFO, logger="hisparse"):
        assert deepgemm.choose("cpu", 64, 128, triton_scores=None) == "triton"
        assert deepgemm.choose("cpu", 64, 128, triton_scores=None) == "triton"
    said = [r.getMessage() for r in caplog.records if "indexer scores" in r.getMessage()]
    assert said == ["hisparse: indexer scores by the Triton kernel (no DeepGEMM importable)"]


@pytest.mark.parametrize(
    "times, want",
    [  # DeepGEMM slower for one token, faster in the sum; faster for one token, slower in sum
        (((9.0, 6.9), (40.0, 76.9)), "deepgemm"),
        (((5.0, 6.9), (80.0, 76.9)), "triton"),
    ],
)
def test_the_choice_takes_the_lower_sum_over_the_probe_shapes(sources, caplog, times, want):
    sources.setitem(sys.modules, "deep_gemm", _fake_module())
    sources.setattr(deepgemm, "supported", lambda heads, dim, device: True)
    by_shape = dict(zip(deepgemm.PROBE, times))
    seen = []

    def probe(found, triton_scores, device, heads, dim, tokens, keys):
        seen.append((tokens, keys))
        return by_shape[(tokens, keys)]

    sources.setattr(deepgemm, "_probe", probe)
    with caplog.at_level(logging.INFO, logger="hisparse"):
        assert deepgemm.choose("cpu", 64, 128, triton_scores=None) == want
        assert deepgemm.choose("cpu", 64, 128, triton_scores=None) == want  # measured once
    assert seen == list(deepgemm.PROBE)
    said = [r.getMessage() for r in caplog.records if "indexer scores" in r.getMessage()]
    (a, b), (c, d) = times
    who = "DeepGEMM" if want == "deepgemm" else "the Triton kernel"
    assert said == [
        f"hisparse: indexer scores by {who} (DeepGEMM from deep_gemm against the Triton kernel: "
        f"{a:.1f} vs {b:.1f} us at 1 x 16384 keys, {c:.1f} vs {d:.1f} us at 64 x 16384 keys; "
        f"the lower sum over these shapes wins: {a + c:.1f} vs {b + d:.1f} us)"
    ]


def test_pick_refuses_what_it_cannot_serve_by_name(sources):
    cfg = _cfg()
    assert deepgemm.pick("auto", False, cfg, "cpu", None) == ("torch", None)
    assert deepgemm.pick("triton", True, cfg, "cpu", "ours") == ("triton", "ours")
    with pytest.raises(ValueError, match="indexer='deepgemm' needs fp8 index keys"):
        deepgemm.pick("deepgemm", False, cfg, "cpu", None)
    with pytest.raises(ValueError, match="pass indexer='triton'"):
        deepgemm.pick("deepgemm", True, cfg, "cpu", "ours")


def _cfg():
    from hisparse.models.dsa.random_checkpoint import random_config

    return DSAConfig.from_hf(random_config("deepseek_v32"))


def test_the_core_refuses_an_unknown_indexer_or_deepgemm_without_paged_keys(sources):
    from hisparse.models.dsa.core import SparseMLACore

    with pytest.raises(ValueError, match="indexer must be one of"):
        SparseMLACore(_cfg(), "fp8", "cpu", indexer="fast")
    with pytest.raises(ValueError, match="indexer='deepgemm' needs fp8 index keys"):
        SparseMLACore(_cfg(), "fp8", "cpu", indexer="deepgemm")
    assert SparseMLACore(_cfg(), "fp8", "cpu").indexer == "torch"
