"""The core's Triton kernels against its torch path on a GPU (marked ``cuda``): the paged FP8
indexer's scores, the top-k they give, attention over FP8 rows with padding (the one-pass row
read with batched products, and the fused sparse MLA kernel), and the whole core in both modes
reading the same rows from different places giving the same bits."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import SparseMLACore, TokenBatch
from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.models.rows import KV_DIM, encode_rows
from tests.devices import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]
GPU = torch.device("cuda")
BS = 16


def _cfg(**kw) -> DSAConfig:
    hf = random_config("deepseek_v32", index_topk=64, num_attention_heads=16, **kw)
    return DSAConfig.from_hf(hf)


def _batch(lens, qlens, blocks=16, seed=0) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    R = len(lens)
    bt = torch.randperm(R * blocks, generator=g).view(R, blocks).to(torch.int32)
    pos, req = [], []
    for r, (n, q) in enumerate(zip(lens, qlens)):
        pos += range(n - q, n)
        req += [r] * q
    return TokenBatch(
        torch.tensor(pos, device=GPU),
        torch.tensor(req, device=GPU),
        torch.tensor(lens, device=GPU),
        bt.to(GPU),
        BS,
    )


def _index_inputs(cfg, core, b: TokenBatch, seed=1):
    g = torch.Generator(device=GPU).manual_seed(seed)
    n_slots = b.block_table.numel() * BS
    keys = torch.randn(n_slots, cfg.index_head_dim, device=GPU, generator=g)
    cache = core.key_cache(b.block_table.numel(), BS, GPU)
    core.store_keys(cache, torch.arange(n_slots, device=GPU), keys, BS)
    T = b.num_tokens
    q = torch.randn(T, cfg.index_n_heads, cfg.index_head_dim, device=GPU, generator=g)
    w = torch.randn(T, cfg.index_n_heads, device=GPU, generator=g)
    return q.to(torch.bfloat16).float(), w, cache


def test_paged_indexer_scores_match_the_torch_path():
    cfg = _cfg()
    fast = SparseMLACore(cfg, "fp8", GPU)
    slow = SparseMLACore(cfg, "fp8", GPU, backend="torch")
    assert fast.kernel_index and not slow.kernel_index
    b = _batch([200, 37, 256, 90], [1, 1, 4, 90])
    q, w, cache = _index_inputs(cfg, fast, b)
    from hisparse.models.dsa.kernels.indexer import paged_scores

    hw = w * (cfg.index_n_heads**-0.5 * cfg.index_head_dim**-0.5)
    got = paged_scores(q, hw, cache, b.block_table, BS, b.req, b.positions)
    want = slow._scores(q, w, cache, b)
    visible = torch.arange(got.shape[1], device=GPU)[None, :] <= b.positions[:, None]
    assert torch.isinf(got[~visible]).all() and (got[~visible] < 0).all()
    # bf16 products of the fp8 keys against float32 ones: relative error of bf16 rounding.
    err = (got[visible] - want[visible]).abs().max().item()
    assert err <= 2e-2 * want[visible].abs().max().item(), err


def test_kernel_top_k_agrees_with_the_torch_path_on_most_rows():
    cfg = _cfg()
    fast = SparseMLACore(cfg, "fp8", GPU)
    slow = SparseMLACore(cfg, "fp8", GPU, backend="torch")
    b = _batch([256, 180, 64, 33], [1, 1, 1, 1])
    q, w, cache = _index_inputs(cfg, fast, b, seed=3)
    a, c = fast.select(q, w, cache, b), slow.select(q, w, cache, b)
    assert a.shape == c.shape == (4, cfg.index_topk)
    for t in range(4):
        sa, sc = set(a[t].tolist()) - {-1}, set(c[t].tolist()) - {-1}
        assert len(sa) == len(sc) == min(cfg.index_topk, int(b.positions[t]) + 1)
        # near-equal scores may swap at the boundary under bf16 rounding
        assert len(sa & sc) >= 0.9 * len(sc), (t, len(sa & sc))


@pytest.mark.parametrize("attention", ["bmm", "fused"])
def test_attention_kernels_match_the_torch_path(attention):
    cfg = _cfg()
    fast = SparseMLACore(cfg, "fp8", GPU, attention=attention)
    slow = SparseMLACore(cfg, "fp8", GPU, backend="torch")
    assert fast.kernel_rows
    g = torch.Generator(device=GPU).manual_seed(4)
    N, T, K = 500, 5, cfg.index_topk
    src = encode_rows(torch.randn(N, KV_DIM, device=GPU, generator=g), "fp8")
    ids = torch.randint(0, N, (T, K), device=GPU, generator=g)
    ids[2, 7:] = -1  # a short context: padding
    ids[4, 1:] = -1
    q_nope = torch.randn(T, cfg.num_heads, cfg.qk_nope_head_dim, device=GPU, generator=g)
    q_pe = torch.randn(T, cfg.num_heads, 64, device=GPU, generator=g)
    kv_b = 0.05 * torch.randn(
        cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512, device=GPU, generator=g
    )
    got = fast.attend(q_nope, q_pe, kv_b, src, ids)
    want = slow.attend(q_nope, q_pe, kv_b, src, ids)
    # bf16 query and products against float32: a few bf16 ulps of the output's scale
    err = (got.float() - want).abs().max().item()
    assert err <= 3e-2 * want.abs().max().item(), err


@pytest.mark.parametrize("attention", ["bmm", "fused"])
def test_the_same_rows_elsewhere_give_the_same_bits(attention):
    """Resident reads rows by slot from the store, HiSparse the same bytes from hot rows at other
    places: the output must not differ by a bit."""
    cfg = _cfg()
    core = SparseMLACore(cfg, "fp8", GPU, attention=attention)
    g = torch.Generator(device=GPU).manual_seed(5)
    N, T, K = 400, 6, cfg.index_topk
    store = encode_rows(torch.randn(N, KV_DIM, device=GPU, generator=g), "fp8")
    ids = torch.randint(0, N, (T, K), device=GPU, generator=g)
    ids[1, 10:] = -1
    perm = torch.randperm(N, device=GPU, generator=g)
    hot = torch.empty_like(store)
    hot[perm] = store  # row i lives at hot row perm[i]
    hot_ids = torch.where(ids >= 0, perm[ids.clamp(min=0)], ids)
    q_nope = torch.randn(T, cfg.num_heads, cfg.qk_nope_head_dim, device=GPU, generator=g)
    q_pe = torch.randn(T, cfg.num_heads, 64, device=GPU, generator=g)
    kv_b = 0.05 * torch.randn(
        cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512, device=GPU, generator=g
    )
    a = core.attend(q_nope, q_pe, kv_b, store, ids)
    b = core.attend(q_nope, q_pe, kv_b, hot, hot_ids)
    assert torch.equal(a, b)
