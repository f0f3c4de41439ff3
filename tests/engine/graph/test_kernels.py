"""The decode step's Triton kernels (hisparse.engine.graph.kernels) against the torch path they
replace: the fused row read is bit-identical to gather + ``decode_rows``; the fused indexer
matches a float64 reference, is deterministic, and gives a row the same scores whatever batch it
is computed in (split and hybrid steps rely on that for parity)."""

from __future__ import annotations

import pytest
import torch

from hisparse.models.rows import decode_rows, encode_rows
from tests.devices import needs_cuda

pytestmark = [pytest.mark.cuda, needs_cuda]


@pytest.fixture(scope="module")
def kernels():
    pytest.importorskip("triton")
    from hisparse.engine.graph import kernels

    return kernels


@pytest.fixture(scope="module")
def mk():
    pytest.importorskip("triton")
    from hisparse.engine.graph import miss_kernels

    return miss_kernels


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(n, 576, generator=g, device="cuda")
    # Rows across 12 orders of magnitude: fp8 subnormals, large scales, an all-zero row.
    kv *= torch.logspace(-6, 6, n, device="cuda")[:, None]
    kv[0] = 0
    return encode_rows(kv, "fp8")


def test_gather_decode_is_decode_rows_bit_for_bit(kernels):
    src = _rows(5000, 1)
    g = torch.Generator(device="cuda").manual_seed(2)
    for shape, dtype in (((7, 64), torch.int64), ((3, 129), torch.int32), ((1,), torch.int64)):
        ids = torch.randint(0, src.shape[0], shape, generator=g, device="cuda", dtype=dtype)
        got = kernels.gather_decode(src, ids)
        want = decode_rows(src[ids.long()], "fp8", torch.bfloat16)
        assert got.shape == (*shape, 576)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), shape


def test_gather_decode_refuses_other_rows(kernels):
    with pytest.raises(ValueError, match="src must be uint8"):
        kernels.gather_decode(torch.zeros(4, 1152, dtype=torch.uint8, device="cuda"),
                              torch.zeros(2, dtype=torch.int64, device="cuda"))  # fmt: skip


def _indexer_inputs(n: int, ctx: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(n, 64, 128, generator=g, device="cuda").bfloat16()
    hw = torch.randn(n, 64, generator=g, device="cuda").bfloat16()
    keys = torch.randn(n, ctx, 128, generator=g, device="cuda").to(torch.float8_e4m3fn)
    scales = torch.rand(n, ctx, generator=g, device="cuda") + 0.01
    return q, hw, keys, scales


def test_fused_indexer_matches_float64(kernels):
    q, hw, keys, scales = _indexer_inputs(3, 1000, 4)  # ctx not a multiple of the tile
    got = kernels.indexer_scores(q, hw, keys, scales)
    k = keys.double() * scales.double()[..., None]
    logits = torch.einsum("nhd,ntd->nht", q.double(), k).relu()
    want = torch.einsum("nh,nht->nt", hw.double(), logits)
    assert got.dtype == torch.float32 and got.shape == (3, 1000)
    scale = want.abs().max()
    assert ((got.double() - want).abs().max() / scale) < 1e-4


def test_fused_indexer_is_deterministic_and_batch_independent(kernels):
    q, hw, keys, scales = _indexer_inputs(6, 4096, 5)
    whole = kernels.indexer_scores(q, hw, keys, scales)
    assert torch.equal(whole, kernels.indexer_scores(q, hw, keys, scales))
    parts = [(0, 2), (2, 6)]
    halves = torch.cat(
        [kernels.indexer_scores(q[a:b], hw[a:b], keys[a:b], scales[a:b]) for a, b in parts]
    )
    assert torch.equal(whole, halves)


def test_fused_indexer_refuses_what_it_cannot_read(kernels):
    q, hw, keys, scales = _indexer_inputs(1, 64, 6)
    with pytest.raises(ValueError, match="powers of two"):
        kernels.indexer_scores(q[:, :4], hw[:, :4], keys, scales)
    with pytest.raises(ValueError, match="keys must be float8_e4m3fn"):
        kernels.indexer_scores(q, hw, keys.bfloat16(), scales)


def test_read_rows_from_host_reads_misses_there_and_fills_their_hot_rows(mk):
    hot = _rows(300, 7)
    host = _rows(1000, 8).cpu().pin_memory()
    pending = torch.full((301,), -1, dtype=torch.int32, device="cuda")
    ids = torch.tensor([[5, 17, 40, 299], [0, 1, 2, 3]], device="cuda")
    miss = {17: 123, 299: 999, 2: 0}  # hot row -> host key
    for h, k in miss.items():
        pending[h] = k
    want_src = hot.clone()
    for h, k in miss.items():
        want_src[h] = host[k].cuda()
    got = mk.read_rows_from_host(hot, host, pending, ids)
    want = decode_rows(want_src[ids], "fp8", torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(hot, want_src)  # the misses' bytes now sit in their hot rows


def test_stage_misses_writes_only_the_planned_entries(mk):
    K = 1500  # not a multiple of the launch block
    pending = torch.full((4 * 4096,), -1, dtype=torch.int32, device="cuda")
    count = torch.tensor([0, 3, K, 1027], dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    dst = torch.stack(
        [torch.randperm(4096, generator=g, device="cuda")[:K] + b * 4096 for b in range(4)]
    ).to(torch.int32)
    src = torch.randint(0, 1 << 30, (4, K), generator=g, device="cuda", dtype=torch.int32)
    want = pending.clone()
    for b in range(4):
        n = int(count[b])
        want[dst[b, :n].long()] = src[b, :n]
    mk.stage_misses(pending, src, dst, count)
    assert torch.equal(pending, want)
    moved = torch.tensor([7], dtype=torch.uint64, device="cuda")  # adds to what was there
    mk.stage_misses(pending, src, dst, count, clear=True, moved=moved)
    assert bool((pending == -1).all())
    assert int(moved.view(torch.int64)) == 7 + int(count.sum()) * 656
    with pytest.raises(ValueError, match="miss_src must be contiguous int32"):
        mk.stage_misses(pending, src.long(), dst, count)
    with pytest.raises(ValueError, match="moved must be a uint64"):
        mk.stage_misses(pending, src, dst, count, moved=moved)  # counting needs clear=True


@pytest.mark.parametrize("block_t,tiles,warps", [(64, 4, 4), (256, 2, 8)])
def test_fused_indexer_launch_shapes_give_the_same_scores(kernels, block_t, tiles, warps):
    q, hw, keys, scales = _indexer_inputs(2, 3000, 7)
    base = kernels.indexer_scores(q, hw, keys, scales)
    got = kernels.indexer_scores(q, hw, keys, scales, block_t=block_t, tiles=tiles, warps=warps)
    assert torch.allclose(got, base, rtol=1e-5, atol=1e-5 * base.abs().max().item())


def test_read_rows_from_host_refuses_unpinned_host(mk):
    hot = _rows(4, 9)
    with pytest.raises(ValueError, match="host must be pinned"):
        mk.read_rows_from_host(hot, hot.cpu(), torch.full((5,), -1, dtype=torch.int32,
                                    device="cuda"), torch.zeros(1, 1, dtype=torch.int64,
                                    device="cuda"))  # fmt: skip


def _plan(batch: int, hot_rows: int, K: int, n_miss: int, keys: int, seed: int):
    """ids [batch, K] of distinct hot rows per request and a miss plan naming n_miss of them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.stack(
        [
            torch.randperm(hot_rows, generator=g, device="cuda")[:K] + b * hot_rows
            for b in range(batch)
        ]
    )
    dst = torch.zeros(batch, K, dtype=torch.int32, device="cuda")
    src = torch.zeros_like(dst)
    for b in range(batch):
        pick = torch.randperm(K, generator=g, device="cuda")[:n_miss]
        dst[b, :n_miss] = ids[b, pick].to(torch.int32)
        src[b, :n_miss] = torch.randperm(keys, generator=g, device="cuda")[:n_miss].to(torch.int32)
    count = torch.full((batch,), n_miss, dtype=torch.int32, device="cuda")
    return ids, (src, dst, count)


def test_copy_misses_then_two_part_read_equals_the_whole_read(kernels, mk):
    hot, host = _rows(3 * 256, 11), _rows(2000, 12).cpu().pin_memory()
    ids, plan = _plan(3, 256, 200, 37, 2000, 13)
    want_hot = hot.clone()
    src, dst, count = plan
    want_hot[dst[:, :37].reshape(-1).long()] = host[src[:, :37].reshape(-1).long().cpu()].cuda()
    pending = torch.full((3 * 256,), -1, dtype=torch.int32, device="cuda")
    mk.stage_misses(pending, *plan)
    untouched = hot.clone()
    out = torch.full((*ids.shape, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    hits = kernels.gather_decode(hot, ids, pending=pending, part="hits", out=out)
    written = ~hits.isnan().all(-1)
    assert int((~written).sum()) == 3 * 37  # the planned misses are left for later, only they
    assert bool((pending[ids[~written]] >= 0).all())
    with pytest.raises(ValueError, match="programs must be >= 1"):
        mk.copy_misses(host, hot, *plan, programs=0)
    with pytest.raises(ValueError, match="block must be a power of two"):
        mk.copy_misses(host, hot, *plan, block=24)
    mk.copy_misses(host, hot, *plan, block=16, programs=2)  # loops over requests and rows
    assert torch.equal(hot, want_hot)  # exactly the planned rows changed
    assert not torch.equal(untouched, want_hot)
    got = kernels.gather_decode(hot, ids, pending=pending, part="misses", out=hits)
    want = decode_rows(want_hot[ids], "fp8", torch.bfloat16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    mk.stage_misses(pending, *plan, clear=True)
    assert bool((pending == -1).all())  # the table is empty for the next layer


def test_gather_decode_parts_need_pending_and_a_matching_out(kernels):
    src = _rows(64, 14)
    ids = torch.arange(8, device="cuda")
    pending = torch.full((64,), -1, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="pending is needed"):
        kernels.gather_decode(src, ids, part="hits")
    with pytest.raises(ValueError, match="part must be one of"):
        kernels.gather_decode(src, ids, pending=pending, part="some")
    with pytest.raises(ValueError, match="out must be contiguous bfloat16"):
        kernels.gather_decode(src, ids, pending=pending, part="misses", out=torch.empty(1))


def test_sparse_mla_matches_float64_over_the_decoded_rows(kernels):
    from hisparse.models.dsa.kernels.mla import sparse_mla

    g = torch.Generator(device="cuda").manual_seed(32)
    # Rows of one scale: a smooth softmax, so the check measures the sums, not which of two
    # near-tied rows of 1e6 wins (``_rows`` spans 12 orders of magnitude).
    src = encode_rows(torch.randn(5000, 576, generator=g, device="cuda"), "fp8")
    n, H, K = 3, 128, 2000  # K not a multiple of the row block
    ids = torch.stack([torch.randperm(5000, generator=g, device="cuda")[:K] for _ in range(n)])
    q = torch.randn(n, H, 576, generator=g, device="cuda").bfloat16()
    scale = 192**-0.5
    kv = kernels.gather_decode(src, ids).double()
    p = (torch.einsum("nhd,nkd->nhk", q.double(), kv) * scale).softmax(-1)
    want = torch.einsum("nhk,nkd->nhd", p, kv[..., :512])
    got = sparse_mla(q, src, ids, scale)
    assert got.shape == (n, H, 512) and got.dtype == torch.bfloat16
    assert float((got.double() - want).abs().max() / want.abs().max()) < 2e-2
    assert torch.equal(got, sparse_mla(q, src, ids, scale))  # deterministic
    halves = torch.cat(
        [sparse_mla(q[:1], src, ids[:1], scale), sparse_mla(q[1:], src, ids[1:], scale)]
    )
    assert torch.equal(got, halves)  # a request's result does not depend on its batch
    for splits in (2, 16):  # runs merged: the same mix up to the order of the sums
        cut = sparse_mla(q, src, ids, scale, splits=splits)
        assert float((cut.double() - want).abs().max() / want.abs().max()) < 2e-2
