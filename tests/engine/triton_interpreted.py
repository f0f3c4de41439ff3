"""The DSA core's Triton kernels run by Triton's interpreter on the CPU (run as a script by
test_triton_interpreter.py, with TRITON_INTERPRET=1 set before Triton is imported).

What the interpreter can check is where values go: which entries a kernel writes and which it
leaves, the selection's slots, the masked softmax, the two ways the paged indexer reads its
keys, and attention's parity between rows read in place and the same bytes elsewhere. Its
float8 arithmetic differs from the GPU's, so bit-exactness against the torch encoders is left to
the CUDA tests (tests/models/dsa/test_core_cuda.py). Shims stand in for what only a GPU has:
``available`` and pinned memory (and its device address); the fused attention runs its
float32-operand variant (the interpreter's bf16 products are wrong). DeepGEMM's fp8 queries
(``fp8_queries.prepare``) are checked bit for bit up to the cast to float8: the interpreter's
cast rounds ties away and drops a carry into the exponent (124 -> 64), so its q8 bytes are
checked against the same cast of torch's float32 values (x / scale, clamped); the GPU's cast
against torch's is test_deepgemm_cuda.py's.
"""

from __future__ import annotations

import functools
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch
import triton
import triton.language as tl

from hisparse.models.dsa import index_keys
from hisparse.models.dsa.config import DSAConfig
from hisparse.models.dsa.core import SparseMLACore, TokenBatch
from hisparse.models.dsa.decoder import rms_norm, rope_half, rope_interleaved
from hisparse.models.dsa.indexer import sorted_positions
from hisparse.models.dsa.kernels import elementwise as ew
from hisparse.models.dsa.kernels import fp8_queries as fq
from hisparse.models.dsa.kernels import indexer as idx_kernel
from hisparse.models.dsa.kernels import misses as miss_kernel
from hisparse.models.dsa.kernels import mla as mla_kernel
from hisparse.models.dsa.kernels import pages as pages_kernel
from hisparse.models.dsa.kernels import rows as kernels
from hisparse.models.dsa.kernels import select as select_kernel
from hisparse.models.dsa.random_checkpoint import random_config
from hisparse.models.rows import FP8_MAX, encode_rows
from hisparse.runtime.miss_plan import MissPlan

_sparse_mla = mla_kernel.sparse_mla
# The interpreter's bf16 products are wrong; the kernel's float32-operand variant is the same
# algorithm over the same (widened) values.
mla_kernel.sparse_mla = functools.partial(_sparse_mla, products="fp32")
torch.Tensor.is_pinned = lambda self: True
# The GPU reads the pinned pool through its address; the interpreter reads tensors.
miss_kernel._HostRows = lambda t, dtype: t.view(dtype)
kernels.available = lambda device: True


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n, 576, generator=g) * torch.logspace(-6, 6, n)[:, None]
    return encode_rows(kv, "fp8")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def check_kernels() -> None:
    g = torch.Generator().manual_seed(3)
    # the selection: sorted positions' slots through the block table (-1 padding last)
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
        assert torch.equal(got, b.slots(sorted_positions(pos, top_k))), f"selection_slots k={k}"
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


@triton.jit
def _to_fp8(x, out, N, BLOCK: tl.constexpr):
    """The interpreter's own float32 -> float8 cast, the kernel's last step."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x + i, mask=i < N).to(tl.float8e4nv)
    tl.store(out + i, v.to(tl.uint8, bitcast=True), mask=i < N)


def check_fp8_queries() -> None:
    """DeepGEMM's inputs in one launch and its mask: torch's bits (q8: up to the cast)."""
    g = torch.Generator().manual_seed(11)
    T, H, D = 6, 16, 64  # rows of D to 1e±3, an all-zero head (scale 1), one large value
    q = (torch.randn(T, H, D, generator=g) * torch.logspace(-3, 3, T)[:, None, None]).bfloat16()
    q[2, 5] = 0.0
    q[4, 0, 7] = 3e4
    hw = torch.rand(T, H, generator=g)
    req, pos = torch.tensor([0, 1, 1, 2, 0, 2]), torch.tensor([3, 100, 101, 0, 447, 20])
    for table in (torch.randperm(24, generator=g).view(3, 8), torch.arange(30).int().view(3, 10)):
        got, want = fq.prepare(q, hw, table, req, pos), fq.prepare_torch(q, hw, table, req, pos)
        for n, a, b in zip(("w", "lens", "bt"), got[1:], want[1:]):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), n
        assert got[0].dtype == torch.float8_e4m3fn and got[0].shape == (T, H, D), "q8"
        assert torch.equal(got[1][2, 5], hw[2, 5]), "an all-zero head keeps scale 1"
        x = q.float()  # quantize_queries' float32 values, up to its cast
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax * (1.0 / FP8_MAX), torch.ones_like(amax))
        v = (x / scale).clamp(-FP8_MAX, FP8_MAX).reshape(-1)
        cast = torch.empty(v.numel(), dtype=torch.uint8)
        _to_fp8[(triton.cdiv(v.numel(), 1024),)](v, cast, v.numel(), 1024)
        assert torch.equal(got[0].view(torch.uint8).reshape(-1), cast), "q8 before the cast"
        same = got[0].view(torch.uint8) == want[0].view(torch.uint8)
        assert float(same.float().mean()) > 0.9, "q8: more apart than the interpreter's cast"
    # the mask, rows strided (DeepGEMM may pad them), a position past the row's end
    out = torch.randn(T, 1500, generator=g)[:, :1300]
    pos = torch.tensor([0, 5, 1299, 2000, 640, 1023])
    want = fq.mask_past_torch(out.clone(), pos)
    assert fq.mask_past(out, pos, block=512) is out and torch.equal(out, want), "mask_past"
    print("fp8_queries ok")


def _miss_plan(seed: int, B: int, H: int, K: int, keys: int, n_miss: int):
    """Hot rows of B requests (H each), their ids [B, K], a host pool and a plan moving n_miss
    host rows into each request's selected hot rows (none for request 1)."""
    g = torch.Generator().manual_seed(seed)
    hot, host = _rows(B * H, seed + 1), _rows(keys, seed + 2)
    ids = torch.stack([torch.randperm(H, generator=g)[:K] + b * H for b in range(B)])
    dst = torch.zeros(B, K, dtype=torch.int32)
    src = torch.zeros_like(dst)
    for b in range(B):
        dst[b, :n_miss] = ids[b, torch.randperm(K, generator=g)[:n_miss]].int()
        src[b, :n_miss] = torch.randperm(keys, generator=g)[:n_miss].int()
    count = torch.tensor([n_miss, 0, n_miss][:B], dtype=torch.int32)
    after = hot.clone()  # the hot rows once the op's gather copied the plan
    for b in range(B):
        n = int(count[b])
        after[dst[b, :n].long()] = host[src[b, :n].long()]
    return hot, host, ids, (src, dst, count), after


def check_misses() -> None:
    """The in-read: staged plan, the read fetching the misses (same bits as a read after the
    gather, the misses' bytes left in their hot rows, no other row written), table emptied."""
    B, H = 3, 64
    hot, host, ids, plan, after = _miss_plan(3, B, H, 40, 900, 7)
    pending = torch.full((B * H,), -1, dtype=torch.int32)
    miss_kernel.stage_misses(pending, *plan)
    want = torch.full_like(pending, -1)
    for b in range(B):
        n = int(plan[2][b])
        want[plan[1][b, :n].long()] = plan[0][b, :n]
    assert torch.equal(pending, want), "stage_misses"
    got = miss_kernel.read_with_misses(hot, host, pending, ids, block=8, warps=2)
    assert _same_bits(got, kernels.gather_decode(after, ids)), "read_with_misses != read after"
    assert torch.equal(hot, after), "read_with_misses: the hot rows differ from the gather's"
    miss_kernel.stage_misses(pending, *plan, clear=True)
    assert bool((pending == -1).all()), "stage_misses(clear=True)"
    # the core with the plan handed over = the core reading after the gather
    cfg = DSAConfig.from_hf(random_config("deepseek_v32", index_topk=40, num_attention_heads=4))
    g = torch.Generator().manual_seed(9)
    q_nope = torch.randn(B, 4, cfg.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(B, 4, 64, generator=g)
    kv_b = 0.05 * torch.randn(4 * (cfg.qk_nope_head_dim + cfg.v_head_dim), 512, generator=g)
    hot, host, ids, plan, after = _miss_plan(4, B, H, 40, 900, 7)
    core = SparseMLACore(cfg, "fp8", "cpu", misses="in_read")
    want = core.attend(q_nope, q_pe, kv_b, after, ids)
    got = core.attend(q_nope, q_pe, kv_b, hot, ids, MissPlan(host, pending, *plan))
    assert torch.equal(got, want) and torch.equal(hot, after), "core.attend(misses=)"
    assert bool((pending == -1).all()), "core.attend(misses=) left the table staged"
    print("misses ok")


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
        assert torch.equal(ew.rope_(x.clone(), cos, sin, start=start, interleaved=inter), want)
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


def check_pages() -> None:
    """Hybrid's page-table translation: integers only, so exact here too (the wrapper sends CPU
    tensors to the torch reference: the kernel is launched directly)."""
    g = torch.Generator().manual_seed(9)
    block, context, slots = 16, 256, 3
    table = torch.randint(0, 5000, (slots, context // block), generator=g)
    for n in (1, 37, 2500):
        keys = torch.randint(-1, slots * context, (n,), generator=g)
        out = torch.full_like(keys, -7)
        pages_kernel._page_rows[(triton.cdiv(n, 1024),)](keys, table, out, n, block, 4, 1024)
        assert torch.equal(out, pages_kernel.page_rows_torch(keys, table, block)), n
    print("pages ok")


if __name__ == "__main__":
    check_pages()
    check_elementwise()
    check_fp8_queries()
    check_kernels()
    check_misses()
    check_attention()
    check_step()
    sys.exit(0)
