"""The core's Triton kernels against its torch path on a GPU (marked ``cuda``): the paged FP8
indexer's scores, the top-k they give, attention over FP8 rows with padding (the one-pass row
read with batched products, and the fused sparse MLA kernel), and the whole core in both modes
reading the same rows from different places giving the same bits."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.dsa import paged_select
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
    want = paged_select.scores(q, w, cache, b, cfg, slow.key_format)
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


def test_fp8_key_store_writes_the_bytes_of_the_torch_path():
    from hisparse.models.dsa import index_keys
    from hisparse.models.dsa.kernels.indexer import store_fp8_keys

    g = torch.Generator(device=GPU).manual_seed(6)
    D, blocks = 128, 12
    k = torch.randn(40, D, device=GPU, generator=g) * torch.rand(40, 1, device=GPU, generator=g)
    k[3] = 0  # an all-zero key keeps scale 1
    slots = torch.randperm(blocks * BS, device=GPU, generator=g)[:40]
    slots[7] = -1  # a padding token of a captured batch: nothing written
    for dtype in (torch.float32, torch.bfloat16):
        got = torch.zeros(blocks, BS * (D + 4), dtype=torch.uint8, device=GPU)
        want = got.clone()
        store_fp8_keys(got, slots, k.to(dtype), BS)
        keep = slots >= 0
        index_keys.store_keys(want, slots[keep], k.to(dtype)[keep], "fp8", BS)
        assert torch.equal(got, want), dtype


@pytest.mark.parametrize("block_size", [16, 64])
def test_paged_indexer_reads_whole_blocks_and_single_keys_alike(block_size):
    """block_t 64 over blocks of 64 keys reads each tile as one run of bytes; over blocks of 16
    key by key. Both score the same keys the same way."""
    from hisparse.models.dsa import index_keys
    from hisparse.models.dsa.kernels.indexer import paged_scores

    g = torch.Generator(device=GPU).manual_seed(7)
    H, D, R, n_blocks = 16, 128, 3, 320 // block_size
    bt = torch.randperm(R * n_blocks, device=GPU, generator=g).view(R, n_blocks).int()
    keys = torch.randn(R * n_blocks * block_size, D, device=GPU, generator=g)
    cache = torch.zeros(R * n_blocks, block_size * (D + 4), dtype=torch.uint8, device=GPU)
    index_keys.store_keys(cache, torch.arange(keys.shape[0], device=GPU), keys, "fp8", block_size)
    req = torch.tensor([0, 1, 2, 2], device=GPU)
    pos = torch.tensor([319, 5, 100, 257], device=GPU)
    q = torch.randn(4, H, D, device=GPU, generator=g).to(torch.bfloat16)
    hw = torch.rand(4, H, device=GPU, generator=g)
    got = paged_scores(q, hw, cache, bt, block_size, req, pos, block_t=64)
    slots = bt[req][:, torch.arange(320, device=GPU) // block_size].long() * block_size
    slots = slots + torch.arange(320, device=GPU) % block_size
    k = index_keys.load_keys(cache, slots, "fp8", D, block_size)  # [4, 320, D]
    logits = torch.relu(torch.einsum("thd,tnd->thn", q.float(), k))
    want = torch.einsum("th,thn->tn", hw, logits)
    visible = torch.arange(320, device=GPU)[None, :] <= pos[:, None]
    assert torch.isinf(got[~visible]).all()
    err = (got[visible] - want[visible]).abs().max().item()
    assert err <= 2e-2 * want[visible].abs().max().item(), err


def test_selection_slots_are_the_sorted_positions_slots():
    from hisparse.models.dsa.indexer import sorted_positions
    from hisparse.models.dsa.kernels.select import selection_slots

    b = _batch([200, 37, 256, 90], [1, 1, 4, 2], seed=8)
    g = torch.Generator(device=GPU).manual_seed(8)
    L, top_k = b.max_context, 64
    scores = torch.randn(b.num_tokens, L, device=GPU, generator=g)
    visible = torch.arange(L, device=GPU)[None, :] <= b.positions[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    for k in (top_k, 40):  # k < top_k: fewer columns than the top-k (a short cache)
        best, idx = scores.topk(k, dim=-1, sorted=False)
        got = selection_slots(best, idx, b.req, b.block_table, BS, top_k)
        pos = torch.where(torch.isfinite(best), idx, torch.full_like(idx, -1))
        assert torch.equal(got, b.slots(sorted_positions(pos, top_k)))
