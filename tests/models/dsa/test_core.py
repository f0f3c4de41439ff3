"""The batched DSA attention core (``hisparse.models.dsa.core``) on the CPU against the
per-request math it replaced: slots from block tables, the index keys' byte formats, the top-k of
a mixed batch (decodes and prefill tokens of requests of different lengths) equal to ranking
each request alone, and attention over selected rows equal to ``attend_rows`` request by
request."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.dsa import attention as mla
from hisparse.models.dsa import index_keys
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import SparseMLACore, TokenBatch, token_rows
from hisparse.models.dsa.indexer import causal_top_k, index_scores
from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.models.rows import KV_DIM, decode_rows, encode_rows

BS = 8


def _cfg(**kw) -> DSAConfig:
    return DSAConfig.from_hf(random_config("deepseek_v32", index_topk=16, **kw))


def _batch(lens, qlens, blocks_per_req=8, seed=0):
    """Requests of context ``lens`` whose last ``qlens`` tokens are this step's, with shuffled
    blocks (so slots are not positions)."""
    g = torch.Generator().manual_seed(seed)
    R = len(lens)
    perm = torch.randperm(R * blocks_per_req, generator=g).view(R, blocks_per_req)
    pos, req = [], []
    for r, (n, q) in enumerate(zip(lens, qlens)):
        pos += range(n - q, n)
        req += [r] * q
    return TokenBatch(
        torch.tensor(pos), torch.tensor(req), torch.tensor(lens), perm.to(torch.int32), BS
    )


def test_slots_follow_the_block_table():
    b = _batch([5, 20], [1, 3])
    pos = torch.tensor([[0, 4, -1], [9, 17, 19], [0, 1, 2], [8, -1, -1]])
    got = b.slots(pos)
    for t in range(4):
        for k in range(3):
            p = int(pos[t, k])
            r = int(b.req[t])
            want = -1 if p < 0 else int(b.block_table[r, p // BS]) * BS + p % BS
            assert int(got[t, k]) == want


def test_token_rows_from_query_starts():
    qsl = torch.tensor([0, 1, 2, 7, 9], dtype=torch.int32)
    assert token_rows(qsl, 9).tolist() == [0, 1, 2, 2, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("fmt", ["fp8", "f32"])
def test_index_keys_round_trip(fmt):
    k = torch.randn(7, 128) * 3
    b = index_keys.encode_keys(k, fmt)
    assert b.dtype == torch.uint8 and b.shape == (7, index_keys.key_bytes(fmt, 128))
    back = index_keys.decode_keys(b, fmt, 128)
    if fmt == "f32":
        assert torch.equal(back, k)
    else:  # one e4m3 step is at most 1/8 of the value (plus subnormals near zero)
        assert ((back - k).abs() <= k.abs() / 8 + 1e-2).all()
    assert index_keys.key_bytes("fp8", 128) == 132


@pytest.mark.parametrize("fmt", ["fp8", "f32"])
def test_paged_key_cache_round_trip(fmt):
    """fp8 blocks keep keys and scales apart (every key 16-byte aligned); any slot order."""
    cache = torch.zeros(3, 8 * index_keys.key_bytes(fmt, 128), dtype=torch.uint8)
    k = torch.randn(10, 128)
    slots = torch.tensor([5, 0, 23, 17, 8, 9, 1, 2, 16, 12])
    index_keys.store_keys(cache, slots, k, fmt, 8)
    got = index_keys.load_keys(cache, slots.view(2, 5), fmt, 128, 8)
    want = index_keys.decode_keys(index_keys.encode_keys(k, fmt), fmt, 128).view(2, 5, 128)
    assert torch.equal(got, want)
    if fmt == "fp8":  # block 0's first key's scale sits after the block's 8 keys
        scale = cache[0, 8 * 128 : 8 * 128 + 4].view(torch.float32)
        assert float(scale) == float(k[1].abs().max() * (1.0 / 448.0))


def test_key_format_is_refused_by_name():
    with pytest.raises(ValueError, match="index key format"):
        SparseMLACore(_cfg(), "f32", "cpu", key_format="int4")


@pytest.mark.parametrize("attention", ["fused", "flashmla"])
def test_the_512_plus_64_kernels_are_refused_by_size_for_other_rows(attention):
    cfg = DSAConfig.from_hf(random_config("glm_moe_dsa", kv_lora_rank=42, qk_rope_head_dim=8))
    with pytest.raises(ValueError, match=r"this model's are 42 \+ 8: pass attention='auto'"):
        SparseMLACore(cfg, "f32", "cpu", attention=attention)
    assert SparseMLACore(cfg, "f32", "cpu").row_bytes == 208  # auto: the torch math, padded rows


@pytest.mark.parametrize("fmt", ["f32", "fp8"])
def test_select_of_a_mixed_batch_equals_each_request_alone(fmt):
    cfg = _cfg()
    core = SparseMLACore(cfg, "f32", "cpu", key_format=fmt)
    lens, qlens = [40, 9, 23, 64, 12], [1, 1, 1, 5, 12]
    b = _batch(lens, qlens)
    g = torch.Generator().manual_seed(1)
    cache = core.key_cache(b.block_table.numel(), BS, "cpu")
    keys_by_req = []
    for r, n in enumerate(lens):
        k = torch.randn(n, cfg.index_head_dim, generator=g)
        row = (b.req == r).nonzero()[0, 0]
        slots = b.slots(torch.arange(n).view(1, -1).expand(b.num_tokens, -1))[row]
        core.store_keys(cache, slots, k, BS)
        keys_by_req.append(index_keys.decode_keys(index_keys.encode_keys(k, fmt), fmt, 128))
    T = b.num_tokens
    q = torch.randn(T, cfg.index_n_heads, cfg.index_head_dim, generator=g)
    w = torch.randn(T, cfg.index_n_heads, generator=g)
    got = core.select(q, w, cache, b)
    assert got.shape == (T, cfg.index_topk)
    for t in range(T):
        r = int(b.req[t])
        n = lens[r]
        scores = index_scores(q[t : t + 1], w[t : t + 1], keys_by_req[r], cfg)
        sel = causal_top_k(scores, torch.arange(n), b.positions[t : t + 1], cfg.index_topk)[0]
        want = sorted(int(p) for p in sel if p >= 0)
        pad = [-1] * (cfg.index_topk - len(want))
        bt = b.block_table[r]
        slots = [int(bt[p // BS]) * BS + p % BS for p in want] + pad
        assert got[t].tolist() == slots, t


@pytest.mark.parametrize("row_format", ["f32", "bf16", "fp8"])
def test_attend_equals_attend_rows_per_token(row_format):
    cfg = _cfg()
    core = SparseMLACore(cfg, row_format, "cpu")
    g = torch.Generator().manual_seed(2)
    N, T, K = 50, 6, cfg.index_topk
    src = encode_rows(torch.randn(N, KV_DIM, generator=g), row_format)
    ids = torch.randint(0, N, (T, K), generator=g)
    ids[1, 5:] = -1  # a token with few rows
    q_nope = torch.randn(T, cfg.num_heads, cfg.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(T, cfg.num_heads, 64, generator=g)
    kv_b = torch.randn(cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512, generator=g)
    got = core.attend(q_nope, q_pe, kv_b * 0.05, src, ids)
    for t in range(T):
        valid = ids[t] >= 0
        rows = decode_rows(src[ids[t][valid]], row_format, torch.float32)
        q_lat = mla.absorb_query(q_nope[t : t + 1], kv_b * 0.05, cfg)
        ones = valid[valid][None]
        o = mla.attend_rows(q_lat, q_pe[t : t + 1], rows[None], ones, cfg.softmax_scale)
        want = mla.expand_values(o, kv_b * 0.05, cfg)
        assert torch.allclose(got[t], want[0], atol=1e-5, rtol=1e-5), t


def test_paged_indexer_tiles_keep_about_eight_programs_per_sm():
    from hisparse.models.dsa.kernels.indexer import tiles_for

    # the H200 sweep's winners: 8 tiles at 30 x 32k, 16 at 39 x 128k, 4 for one request
    assert (tiles_for(30, 32832), tiles_for(39, 131136), tiles_for(1, 32832)) == (8, 16, 4)
    assert tiles_for(112, 32832) == 16 and tiles_for(0, 32832) == 4


def test_the_row_read_takes_the_misses_only_where_the_core_reads_them():
    from hisparse.models.dsa.core import IN_READ_FROM

    cpu = SparseMLACore(_cfg(), "fp8", "cpu")
    assert not cpu.kernel_rows and not cpu.reads_misses(IN_READ_FROM)  # no kernels on the CPU
    with pytest.raises(ValueError, match="misses= given"):
        cpu.attend(None, None, None, None, torch.zeros(IN_READ_FROM, 4, dtype=torch.long), object())
    with pytest.raises(ValueError, match="misses must be one of"):
        SparseMLACore(_cfg(), "fp8", "cpu", misses="beside")
    kern = SparseMLACore(_cfg(), "fp8", "cpu")
    kern.kernel_rows = True  # the policy alone (the kernels need a GPU)
    assert not kern.reads_misses(IN_READ_FROM - 1) and kern.reads_misses(IN_READ_FROM)
    kern.misses = "in_read"
    assert kern.reads_misses(1)
    kern.misses, kern.attention = "auto", "fused"
    assert not kern.reads_misses(IN_READ_FROM)
    kern.attention, kern.misses = "bmm", "gather"
    assert not kern.reads_misses(10 * IN_READ_FROM)
