"""FlashMLA's sparse FP8 decode as the core's attention on a GPU (marked ``cuda``; skipped where
no FlashMLA is importable, e.g. benchmarks/baselines/build_flashmla.sh not run): close to the
Triton path on the same rows, padding ignored, the same bits from the same bytes at other rows
(resident vs hot buffer), replayed from a CUDA graph as run eagerly, and the choice measured."""

from __future__ import annotations

import logging

import pytest
import torch

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import SparseMLACore
from hisparse.models.dsa.kernels import flashmla
from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.models.rows import encode_rows
from tests.devices import needs_cuda

pytestmark = [
    pytest.mark.cuda,
    needs_cuda,
    pytest.mark.skipif(flashmla.find() is None, reason="no FlashMLA importable"),
]
GPU = torch.device("cuda")
T, K, N = 5, 256, 8192


def _setup(heads=64):
    cfg = DSAConfig.from_hf(random_config("deepseek_v32", index_topk=K, num_attention_heads=heads))
    g = torch.Generator(device=GPU).manual_seed(0)
    src = encode_rows(torch.randn(N, 576, device=GPU, generator=g), "fp8")
    ids = torch.stack([torch.randperm(N, device=GPU, generator=g)[:K] for _ in range(T)])
    ids = ids.sort(dim=1).values
    ids[1, 40:] = -1  # a short context: padding
    q = (torch.randn(T, heads, 576, device=GPU, generator=g) * 0.5).bfloat16()
    return cfg, src, ids, q


@pytest.mark.parametrize("heads", [16, 64, 128])  # 16: a TP rank's share, padded to 64
def test_flashmla_agrees_with_the_triton_path_and_ignores_padding(heads):
    cfg, src, ids, q = _setup(heads)
    flash = SparseMLACore(cfg, "fp8", GPU, attention="flashmla")
    bmm = SparseMLACore(cfg, "fp8", GPU, attention="bmm")
    a = flash.attend_latent(q, src, ids).float()
    b = bmm.attend_latent(q, src, ids).float()
    assert float((a - b).abs().max() / b.abs().max()) < 2e-2
    # the padded request: its 40 rows only (garbage in the padded ids' rows changes nothing)
    other = src.clone()
    keep = torch.zeros(N, dtype=torch.bool, device=GPU)
    keep[ids[ids >= 0]] = True
    other[~keep] = encode_rows(torch.randn(int((~keep).sum()), 576, device=GPU), "fp8")
    c = flash.attend_latent(q, other, ids).float()
    assert torch.equal(a, c), "rows outside the selection changed the result"


def test_the_same_bytes_elsewhere_give_the_same_bits_eagerly_and_replayed():
    cfg, src, ids, q = _setup()
    core = SparseMLACore(cfg, "fp8", GPU, attention="flashmla")
    perm = torch.randperm(N, device=GPU)
    hot = torch.empty_like(src)
    hot[perm] = src
    hot_ids = torch.where(ids >= 0, perm[ids.clamp(min=0)], ids)
    a = core.attend_latent(q, src, ids)
    b = core.attend_latent(q, hot, hot_ids)
    assert torch.equal(a, b)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = core.attend_latent(q, hot, hot_ids)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, a)


def test_auto_measures_and_says_which(caplog, monkeypatch):
    monkeypatch.setattr(flashmla, "_CHOICE", {})
    cfg, *_ = _setup(heads=128)
    with caplog.at_level(logging.INFO, logger="hisparse"):
        core = SparseMLACore(cfg, "fp8", GPU)
    said = [r.getMessage() for r in caplog.records if "sparse MLA by" in r.getMessage()]
    assert len(said) == 1 and "at batch 64" in said[0], said
    assert ("by FlashMLA" in said[0]) == (core.attention == "flashmla"), said
