"""Which FlashMLA the core would use, found without a GPU: sources in order, unsupported builds
skipped, the page block view, and the choice said in one line when none is importable (the CUDA
half, FlashMLA against the Triton kernels on the same rows, is test_flashmla_cuda.py)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from hisparse.models.dsa.kernels import flashmla


def _module(name: str, supported=None):
    m = types.ModuleType(name)
    m.flash_mla_with_kvcache = lambda *a, **k: None
    m.get_mla_metadata = lambda: (object(), None)
    if supported is not None:
        m.is_flashmla_sparse_supported = lambda: (supported, None if supported else "no sm90")
    return m


@pytest.fixture
def sources(monkeypatch):
    monkeypatch.setattr(flashmla, "_SOURCES", list(flashmla._SOURCES))
    monkeypatch.setattr(flashmla, "_CHOICE", {})
    return monkeypatch


def test_sources_are_tried_in_order_and_unsupported_builds_skipped(sources):
    sources.setitem(sys.modules, "flash_mla", None)  # not importable
    assert flashmla.find() is None
    sources.setitem(sys.modules, "fake_vllm_flashmla", _module("fake_vllm_flashmla", False))
    flashmla.add_source("fake_vllm_flashmla")
    assert flashmla.find() is None, "a build that says it is unsupported must not be used"
    sources.setitem(sys.modules, "flash_mla", _module("flash_mla"))
    assert flashmla.find().name == "flash_mla"
    sources.setitem(sys.modules, "fake_vllm_flashmla", _module("fake_vllm_flashmla", True))
    assert flashmla.find().name == "fake_vllm_flashmla", "a registered source comes first"


def test_no_flashmla_means_the_triton_kernels_said_once(sources, caplog):
    sources.setitem(sys.modules, "flash_mla", None)
    with caplog.at_level(logging.INFO, logger="hisparse"):
        assert flashmla.choose("cpu", 128, 2048, bmm=None) == "bmm"
        assert flashmla.choose("cpu", 128, 2048, bmm=None) == "bmm"
    said = [r.getMessage() for r in caplog.records if "sparse MLA" in r.getMessage()]
    assert said == ["hisparse: sparse MLA by the Triton kernels (no FlashMLA importable)"]


@pytest.mark.parametrize("rows,block", [(64 * 7, 64), (96, 32), (4097, 1), (4096 * 3, 64)])
def test_the_page_block_view_covers_every_row(rows, block):
    assert flashmla._page_block(rows) == block


def test_explicit_flashmla_without_it_is_refused_by_name(sources):
    from hisparse.models.dsa.config import DSAConfig
    from hisparse.models.dsa.core import SparseMLACore
    from hisparse.models.dsa.kernels import rows as row_kernels
    from hisparse.models.dsa.random_checkpoint import random_config

    sources.setitem(sys.modules, "flash_mla", None)
    sources.setattr(row_kernels, "available", lambda device: True)
    cfg = DSAConfig.from_hf(random_config("deepseek_v32"))
    with pytest.raises(ValueError, match="attention='flashmla' needs FlashMLA"):
        SparseMLACore(cfg, "fp8", "cpu", attention="flashmla")
    assert SparseMLACore(cfg, "fp8", "cpu").attention == "bmm"  # auto, nothing to measure


@pytest.mark.parametrize(
    "times, want",
    [  # FlashMLA slower for one request, faster in the sum (as on the H200 with a warm L2)
        (((27.0, 20.0), (100.0, 260.0)), "flashmla"),
        (((15.0, 20.0), (270.0, 260.0)), "bmm"),  # faster for one, slower in the sum
    ],
)
def test_the_choice_takes_the_lower_sum_over_the_probe_batches(sources, caplog, times, want):
    sources.setitem(sys.modules, "flash_mla", _module("flash_mla"))
    by_batch = dict(zip(flashmla.PROBE_BATCHES, times))
    seen = []

    def probe(flash, bmm, device, heads, top_k, batch):
        seen.append(batch)
        return by_batch[batch]

    sources.setattr(flashmla, "_probe", probe)
    with caplog.at_level(logging.INFO, logger="hisparse"):
        assert flashmla.choose("cpu", 128, 2048, bmm=None) == want
        assert flashmla.choose("cpu", 128, 2048, bmm=None) == want  # measured once
    assert seen == list(flashmla.PROBE_BATCHES)
    said = [r.getMessage() for r in caplog.records if "sparse MLA" in r.getMessage()]
    (a, b), (c, d) = times
    who = "FlashMLA" if want == "flashmla" else "the Triton kernels"
    assert said == [
        f"hisparse: sparse MLA by {who} (FlashMLA from flash_mla against the Triton kernels: "
        f"{a:.0f} vs {b:.0f} us at batch 1, {c:.0f} vs {d:.0f} us at batch 64; the lower sum "
        f"over these batches wins: {a + c:.0f} vs {b + d:.0f} us)"
    ]


def test_more_heads_than_flashmla_takes_means_the_triton_kernels(sources, caplog):
    sources.setitem(sys.modules, "flash_mla", _module("flash_mla"))
    sources.setattr(flashmla, "_probe", lambda *a: pytest.fail("no probe past 128 heads"))
    with caplog.at_level(logging.INFO, logger="hisparse"):
        assert flashmla.choose("cpu", 192, 2048, bmm=None) == "bmm"
    said = [r.getMessage() for r in caplog.records if "sparse MLA" in r.getMessage()]
    assert said == ["hisparse: sparse MLA by the Triton kernels (FlashMLA lacks 192 heads)"]
    with pytest.raises(ValueError, match="at most 128 query heads, the model has 192"):
        flashmla.require(flashmla.find(), 192)
    with pytest.raises(ValueError, match="needs FlashMLA importable"):
        flashmla.require(None, 128)


def test_a_probe_that_raises_means_the_triton_kernels(sources, caplog):
    sources.setitem(sys.modules, "flash_mla", _module("flash_mla"))

    def probe(*a):
        raise RuntimeError("Unsupported h_q: 32")

    sources.setattr(flashmla, "_probe", probe)
    with caplog.at_level(logging.INFO, logger="hisparse"):
        assert flashmla.choose("cpu", 32, 2048, bmm=None) == "bmm"
    said = [r.getMessage() for r in caplog.records if "sparse MLA" in r.getMessage()]
    assert said == [
        "hisparse: sparse MLA by the Triton kernels (FlashMLA from flash_mla failed its probe: "
        "RuntimeError: Unsupported h_q: 32)"
    ]


@pytest.mark.parametrize("heads, top_k", [(16, 40), (128, 2048), (64, 100)])
def test_ids_and_heads_reach_flashmla_in_its_blocks(heads, top_k):
    # FlashMLA aborts the process (an assert, not an exception) on a top-k not a multiple of 64
    seen = {}

    def kernel(q, cache, _a, _b, dv, plan, softmax_scale, is_fp8_kvcache, indices):
        seen.update(q=q.shape, ids=indices)
        return (torch.zeros(q.shape[0], 1, q.shape[2], dv),)

    m = _module("flash_mla")
    m.flash_mla_with_kvcache = kernel
    ids = torch.arange(2 * top_k).view(2, top_k)
    out = flashmla.FlashMLADecode(m)(torch.zeros(2, heads, 576), torch.zeros(256, 656), ids, 0.1)
    assert out.shape == (2, heads, 512)
    assert seen["q"][2] % flashmla.HEAD_BLOCK == 0
    got = seen["ids"].view(2, -1)
    assert got.shape[1] % flashmla.TOPK_BLOCK == 0 and got.shape[1] - top_k < flashmla.TOPK_BLOCK
    assert torch.equal(got[:, :top_k], ids.int()) and (got[:, top_k:] == -1).all()
