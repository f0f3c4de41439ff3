"""The graph engine's Triton kernels run by Triton's interpreter on the CPU (run as a script by
test_triton_interpreter.py, with TRITON_INTERPRET=1 set before Triton is imported).

What the interpreter can check is where rows go: which entries a kernel writes, which it leaves,
which bytes land in which hot row, and the decode step's parity between resident and every miss
path. Its float8 arithmetic differs from the GPU's, so bit-exactness against ``decode_rows`` is
left to the CUDA tests (graph/test_kernels.py); here every comparison is between two runs under
the interpreter. Three shims stand in for what only a GPU has: pinned memory (``is_pinned``),
a host pointer the device reads (``_HostRows``: here the tensor itself) and ``available``; the
fused attention runs its float32-operand variant (the interpreter's bf16 products are wrong).
"""

from __future__ import annotations

import functools
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch

from hisparse.engine.graph import (
    GraphConfig,
    KVStore,
    Weights,
    counters,
    kernels,
)
from hisparse.engine.graph import miss_kernels as mk
from hisparse.models.dsa.kernels import mla as mla_kernel
from hisparse.models.rows import encode_rows
from tests.engine.graph.test_step import _eager, _same

_sparse_mla = mla_kernel.sparse_mla
# The interpreter's bf16 products are wrong; the kernel's float32-operand variant is the same
# algorithm over the same (widened) values.
mla_kernel.sparse_mla = functools.partial(_sparse_mla, products="fp32")
mk._HostRows = lambda t, dtype: t.view(dtype)
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
    B, H, K, n_miss, keys = 3, 64, 40, 7, 900
    hot, host = _rows(B * H, 11), _rows(keys, 12)
    ids = torch.stack([torch.randperm(H, generator=g)[:K] + b * H for b in range(B)])
    dst = torch.zeros(B, K, dtype=torch.int32)
    src = torch.zeros_like(dst)
    for b in range(B):
        dst[b, :n_miss] = ids[b, torch.randperm(K, generator=g)[:n_miss]].int()
        src[b, :n_miss] = torch.randperm(keys, generator=g)[:n_miss].int()
    count = torch.tensor([n_miss, 0, n_miss], dtype=torch.int32)  # a request with no miss
    plan = (src, dst, count)
    want_hot, want_pending = hot.clone(), torch.full((B * H,), -1, dtype=torch.int32)
    for b in range(B):
        n = int(count[b])
        want_hot[dst[b, :n].long()] = host[src[b, :n].long()]
        want_pending[dst[b, :n].long()] = src[b, :n]
    whole = kernels.gather_decode(want_hot, ids)  # the interpreter's own full read

    pending = torch.full((B * H,), -1, dtype=torch.int32)
    mk.stage_misses(pending, *plan)
    assert torch.equal(pending, want_pending), "stage_misses"

    beside = hot.clone()
    out = torch.full((B, K, 576), float("nan"), dtype=torch.bfloat16)
    kernels.gather_decode(beside, ids, pending=pending, part="hits", out=out)
    left = out.isnan().all(-1)
    assert int(left.sum()) == int(count.sum()), "part='hits' must leave exactly the misses"
    assert bool((pending[ids[left]] >= 0).all()), "part='hits' left a hit"
    mk.copy_misses(host, beside, *plan, block=2, programs=2)  # loops over requests and rows
    assert torch.equal(beside, want_hot), "copy_misses wrote other rows than the plan's"
    odd = hot.clone()
    mk.copy_misses(host, odd, *plan, block=4, programs=3)  # any program count
    assert torch.equal(odd, want_hot), "copy_misses with 3 programs"
    kernels.gather_decode(beside, ids, pending=pending, part="misses", out=out)
    assert _same_bits(out, whole), "hits then misses != the whole read"

    in_read = hot.clone()
    got = mk.read_rows_from_host(in_read, host, pending, ids, block=8, warps=2)
    assert _same_bits(got, whole), "read_rows_from_host != the whole read"
    assert torch.equal(in_read, want_hot), "read_rows_from_host filled other hot rows"

    moved = torch.zeros(1, dtype=torch.uint64)
    mk.stage_misses(pending, *plan, clear=True, moved=moved)
    assert bool((pending == -1).all()), "stage_misses(clear=True)"
    assert int(moved.view(torch.int64)) == int(count.sum()) * 656, "stage_misses(moved=)"
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
    # The interpreter's cost is per program: a step smaller than GraphConfig.tiny's (top-k 16,
    # 4 requests, 3 steps) still takes every path with misses and mostly hits, and the fused
    # attention cuts rows into 2 runs instead of the 16 that splits_for gives the CPU (it sizes
    # for 132 SMs), so the runs are still merged; check_attention covers other counts.
    mla_kernel.splits_for = lambda *args, **kwargs: 2
    torch.manual_seed(0)
    cfg = GraphConfig.tiny(top_k=16, hot_size=24, ctx_len=128)
    w, kv = Weights(cfg, "cpu"), KVStore(cfg, 4, "cpu")
    _, ref = _eager(cfg, w, kv, "resident", 4, 3, fused=True)
    cases = [
        ("hisparse", dict(misses="in_read")),
        ("hisparse", dict(misses="beside")),
        ("hisparse", dict(misses="in_read", split=2)),
        ("hisparse", dict(misses="beside", split=2)),
        ("hybrid", dict(misses="beside", resident=2)),
        ("hybrid", dict(misses="in_read", resident=2)),
    ]
    _, fused_ref = _eager(cfg, w, kv, "resident", 4, 3, fused=True, attention="fused")
    assert not _same(ref, fused_ref)  # another summation: close, not the same bits
    cases_fused = [
        ("hisparse", dict(misses="op")),
        ("hisparse", dict(misses="beside", split=2)),
        ("hybrid", dict(misses="beside", resident=2)),
    ]
    for mode, kw in cases_fused:
        _, out = _eager(cfg, w, kv, mode, 4, 3, fused=True, attention="fused", **kw)
        assert _same(fused_ref, out), f"fused attention {mode} {kw}: not bit-identical"
    for mode, kw in cases:
        step, out = _eager(cfg, w, kv, mode, 4, 3, fused=True, **kw)
        hits, misses, moved = counters(step)
        assert misses > 0 and hits > misses, (mode, kw, hits, misses)
        assert moved == misses * 656, (mode, kw, moved, misses)  # beside and in-read alike
        assert _same(ref, out), f"{mode} {kw}: not bit-identical to resident"
        assert bool((step.pending == -1).all()), f"{mode} {kw}: pending entries left"
    # The control: the same step with the misses' read skipped must break parity.
    whole = kernels.gather_decode

    def skip_misses(src, ids, *, pending=None, part="all", out=None):
        return out if part == "misses" else whole(src, ids, pending=pending, part=part, out=out)

    kernels.gather_decode = skip_misses
    _, out = _eager(cfg, w, kv, "hisparse", 4, 3, fused=True, misses="beside")
    kernels.gather_decode = whole
    assert not _same(ref, out), "the negative control kept parity: the check has no teeth"
    print("step ok")


if __name__ == "__main__":
    check_kernels()
    check_attention()
    check_step()
    sys.exit(0)
