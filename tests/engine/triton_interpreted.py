"""The DSA core's Triton kernels run by Triton's interpreter on the CPU (run as a script by
test_triton_interpreter.py, with TRITON_INTERPRET=1 set before Triton is imported).

What the interpreter can check is where values go: which entries a kernel writes and which it
leaves, the selection's slots, the masked softmax, the two ways the paged indexer reads its
keys, and attention's parity between rows read in place and the same bytes elsewhere. Its
float8 arithmetic differs from the GPU's, so bit-exactness against the torch encoders is left to
the CUDA tests (tests/models/dsa/test_core_cuda.py). Two shims stand in for what only a GPU has:
``available`` and pinned memory; the fused attention runs its float32-operand variant (the
interpreter's bf16 products are wrong).
"""

from __future__ import annotations

import functools
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch

from hisparse.models.dsa import index_keys
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import SparseMLACore, TokenBatch, _sorted
from hisparse.models.dsa.decoder import rms_norm, rope_half, rope_interleaved
from hisparse.models.dsa.kernels import elementwise as ew
from hisparse.models.dsa.kernels import indexer as idx_kernel
from hisparse.models.dsa.kernels import mla as mla_kernel
from hisparse.models.dsa.kernels import rows as kernels
from hisparse.models.dsa.kernels import select as select_kernel
from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.models.rows import encode_rows

_sparse_mla = mla_kernel.sparse_mla
# The interpreter's bf16 products are wrong; the kernel's float32-operand variant is the same
# algorithm over the same (widened) values.
mla_kernel.sparse_mla = functools.partial(_sparse_mla, products="fp32")
torch.Tensor.is_pinned = lambda self: True
kernels.available = lambda device: True


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, 576, generator=g) * torch.logspace(-6, 6, n)[:, None]
    return encode_rows(kv, "fp8")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def check_kernels() -> None:
    g = torch.Generator().manual_seed(3)
    # the selection: sort keys, one sort, slots through the block table (-1 padding last)
    bs, top_k = 16, 32
    bt = torch.randperm(18, generator=g).view(3, 6).int()
    b = TokenBatch(torch.tensor([95, 10, 40, 3]), torch.tensor([0, 1, 1, 2]),
                   torch.tensor([96, 41, 4]), bt, bs)  # fmt: skip
    scores = torch.randn(4, 96, generator=g)
    scores[torch.arange(96)[None, :] > b.positions[:, None]] = float("-inf")
    for k in (top_k, 20):
        best, idx = scores.topk(k, dim=-1, sorted=False)
        got = select_kernel.selection_slots(best, idx, b.req, bt, bs, top_k)
        pos = torch.where(torch.isfinite(best), idx, torch.full_like(idx, -1))
        assert torch.equal(got, b.slots(_sorted(pos, top_k))), f"selection_slots k={k}"
    # the masked softmax: padding (-1) takes no weight
    s = torch.randn(3, 6, 40, generator=g)
    ids = torch.randint(0, 99, (3, 40), generator=g)
    ids[1, 30:] = -1
    got = mla_kernel.masked_softmax(s, ids)
    want = s.masked_fill((ids < 0).unsqueeze(1), float("-inf")).softmax(-1)
    assert float((got - want).abs().max()) < 1e-6, "masked_softmax"
    # the fp8 key store: only the slots given, a slot of -1 skipped, keys decode close
    D = 64
    cache = torch.full((10, bs * (D + 4)), 7, dtype=torch.uint8)
    slots = torch.tensor([3, 17, -1, 100])
    k = torch.randn(4, D, generator=g)
    idx_kernel.store_fp8_keys(cache, slots, k, bs)
    keep = slots >= 0
    want = cache.clone().fill_(7)
    index_keys.store_keys(want, slots[keep], k[keep], "fp8", bs)
    at = index_keys._byte_index(cache, slots[keep], "fp8", D, bs)
    got_b, want_b = cache.view(-1)[at], want.view(-1)[at]
    assert torch.equal(got_b[:, D:], want_b[:, D:]), "store_fp8_keys: the scales"
    # the interpreter rounds a few values to float8 differently from torch (the GPU does not)
    assert float((got_b[:, :D] != want_b[:, :D]).float().mean()) < 0.05, "store_fp8_keys: values"
    untouched = torch.ones(10 * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    rest = index_keys._byte_index(cache, torch.nonzero(untouched).squeeze(1), "fp8", D, bs)
    assert bool((cache.view(-1)[rest.reshape(-1)] == 7).all()), "store_fp8_keys wrote elsewhere"
    # the paged indexer: a tile inside one block (one run of bytes) and key by key agree
    H, bs = 16, 64
    cache = torch.zeros(6, bs * (D + 4), dtype=torch.uint8)
    index_keys.store_keys(cache, torch.arange(6 * bs), torch.randn(6 * bs, D, generator=g),
                          "fp8", bs)  # fmt: skip
    bt = torch.randperm(6, generator=g).view(2, 3).int()
    q, hw = torch.randn(3, H, D, generator=g), torch.rand(3, H, generator=g)
    req, pos = torch.tensor([0, 1, 1]), torch.tensor([150, 5, 191])
    whole = idx_kernel.paged_scores(q, hw, cache, bt, bs, req, pos, block_t=64, tiles=1)
    keyed = idx_kernel.paged_scores(q, hw, cache, bt, bs, req, pos, block_t=16, tiles=2)
    assert torch.equal(torch.isinf(whole), torch.isinf(keyed)), "paged_scores masks"
    fin = torch.isfinite(whole)
    assert torch.allclose(whole[fin], keyed[fin], rtol=1e-4, atol=1e-4), "paged_scores paths"
    print("kernels ok")


def check_attention() -> None:
    g = torch.Generator().manual_seed(21)
    src = _rows(300, 22)
    n, H, K = 2, 40, 70  # heads over two blocks, the last one partly empty; K not a block multiple
    ids = torch.stack([torch.randperm(300, generator=g)[:K] for _ in range(n)])
    q = torch.randn(n, H, 576, generator=g).bfloat16()
    scale = 576**-0.5
    got = mla_kernel.sparse_mla(q, src, ids, scale, heads_per_program=32, block=16)
    kv = kernels.gather_decode(src, ids).double()
    p = (torch.einsum("nhd,nkd->nhk", q.double(), kv) * scale).softmax(-1)
    want = torch.einsum("nhk,nkd->nhd", p, kv[..., :512])
    err = float((got.double() - want).abs().max() / want.abs().max())
    assert err < 1e-2, f"sparse_mla off by {err:.2e} (bf16 output: ~4e-3)"
    # Rows cut into runs of 32 merged to the same mix (splits=4 leaves its last run empty).
    for splits in (3, 4):
        cut = mla_kernel.sparse_mla(
            q, src, ids, scale, heads_per_program=16, block=16, splits=splits
        )
        assert float((cut.double() - want).abs().max() / want.abs().max()) < 1e-2, splits
    print("attention ok")


def check_step() -> None:
    """The core's kernel attention ("bmm" and "fused") over rows read in place and over the
    same bytes at other rows (as HiSparse's hot buffers hold them): the same bits."""
    cfg = DSAConfig.from_hf(random_config("deepseek_v32", index_topk=24, num_attention_heads=4))
    g = torch.Generator().manual_seed(5)
    N, T, K = 120, 3, cfg.index_topk
    store = _rows(N, 31)
    ids = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)])
    ids[1, 10:] = -1
    perm = torch.randperm(N, generator=g)
    hot = torch.empty_like(store)
    hot[perm] = store
    hot_ids = torch.where(ids >= 0, perm[ids.clamp(min=0)], ids)
    q_nope = torch.randn(T, cfg.num_heads, cfg.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(T, cfg.num_heads, 64, generator=g)
    kv_b = 0.05 * torch.randn(cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512,
                              generator=g)  # fmt: skip
    mla_kernel.splits_for = lambda *args, **kwargs: 2
    for attention in ("bmm", "fused"):
        core = SparseMLACore(cfg, "fp8", "cpu", attention=attention)
        assert core.kernel_rows, "the shim did not enable the kernels"
        a = core.attend(q_nope, q_pe, kv_b, store, ids)
        b = core.attend(q_nope, q_pe, kv_b, hot, hot_ids)
        assert torch.equal(a, b), f"{attention}: the same rows elsewhere gave other bits"
        c = core.attend(q_nope, q_pe, kv_b, hot, ids)  # the control: other rows
        assert not torch.equal(a, c), f"{attention}: the control kept parity"
    print("step ok")


def check_elementwise() -> None:
    """float32 only: the interpreter's bf16 and fp8 conversions truncate where the GPU rounds."""
    g = torch.Generator().manual_seed(8)
    T = 6
    cos, sin = torch.randn(T, 64, generator=g), torch.randn(T, 64, generator=g)
    x = torch.randn(T, 3, 200, generator=g)[..., :192]
    for start, inter, turn in ((128, True, rope_interleaved), (0, False, rope_half)):
        want = torch.cat([x[..., :start], turn(x[..., start : start + 64], cos, sin),
                          x[..., start + 64 :]], dim=-1)  # fmt: skip
        assert torch.equal(ew.rope(x, cos, sin, start=start, interleaved=inter), want), start
    kv = torch.randn(T, 576, generator=g) * torch.logspace(-4, 4, T)[:, None]
    w = 1 + 0.1 * torch.randn(512, generator=g)
    row = ew.latent_row(kv, w, 1e-6, cos, sin)
    assert torch.equal(row[:, 512:], rope_interleaved(kv[:, 512:], cos, sin)), "latent_row rope"
    assert torch.allclose(row[:, :512], rms_norm(kv[:, :512], w, 1e-6), rtol=1e-5), "latent norm"
    assert torch.allclose(ew.rms_norm(kv[:, :100], w[:100], 1e-6),
                          rms_norm(kv[:, :100], w[:100], 1e-6), rtol=1e-5), "rms_norm"  # fmt: skip
    got, want = ew.encode_fp8_rows(kv), encode_rows(kv, "fp8")
    assert torch.equal(got[:, 512:528], want[:, 512:528]), "encode_fp8_rows: the scales"
    assert float((got[:, :512] != want[:, :512]).float().mean()) < 0.05, "encode: values"
    print("elementwise ok")


if __name__ == "__main__":
    check_elementwise()
    check_kernels()
    check_attention()
    check_step()
    sys.exit(0)
