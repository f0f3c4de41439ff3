"""The CUDA backend against the C++ CPU reference, bit for bit (docs/ops.md).

Everything here needs a CUDA device and the CUDA build of the extension; without them the module
is skipped cleanly. Workloads are random multi-step decode traces: realistic reuse between steps,
padding rows and entries, duplicate state rows, duplicate entries, out-of-range keys, a resident
tier, state-row reuse through both invalidate modes, and gathers for index groups of 1 and 4
layers with 656- and 1152-byte rows.
"""

from __future__ import annotations

import pytest
import torch

from hisparse import ops
from tests.devices import needs_cuda

# Argument validation on both backends (the same error on CUDA as on the CPU, word for word):
# tests/ops/test_validation.py, whose breaker tables run on the `device` fixture.
pytestmark = [pytest.mark.cuda, needs_cuda]

DEV = "cuda"
I32 = torch.int32


# --------------------------------------------------------------------------------------------
# Workload generation
# --------------------------------------------------------------------------------------------


class Trace:
    """A random decode trace: each state row's selection drifts from step to step."""

    def __init__(
        self,
        *,
        B,
        K,
        S,
        num_keys,
        miss_rate,
        seed,
        resident=False,
        pad_rows=True,
        dup_rows=True,
        pad_entries=True,
        bad_keys=True,
        dup_entries=True,
    ):
        self.B, self.K, self.S, self.num_keys = B, K, S, num_keys
        self.miss_rate = miss_rate
        self.g = torch.Generator().manual_seed(seed)
        self.resident = resident
        self.pad_rows, self.dup_rows = pad_rows, dup_rows
        self.pad_entries, self.bad_keys, self.dup_entries = pad_entries, bad_keys, dup_entries
        self.prev = {}

    def _rand(self, n, lo, hi):
        return torch.randint(lo, hi, (n,), generator=self.g, dtype=torch.int64)

    def _fresh(self, n):
        return self._rand(n, 0, self.num_keys).to(I32)

    def step(self):
        B, K, S = self.B, self.K, self.S
        perm = torch.randperm(S, generator=self.g)[:B]
        state_rows = perm.to(I32).clone()
        if B > 1 and self.pad_rows:
            for r in self._rand(max(1, B // 16), 0, B).tolist():
                state_rows[r] = -1 if r % 2 else S + r  # padding and out-of-range rows
        if B > 2 and self.dup_rows:
            for r in self._rand(max(1, B // 16), 1, B).tolist():
                state_rows[r] = state_rows[int(self._rand(1, 0, r)[0])]  # duplicate state row
        top_k = torch.empty(B, K, dtype=I32)
        for r in range(B):
            s = int(state_rows[r])
            prev = self.prev.get(s)
            if prev is None:
                row = self._fresh(K)
            else:
                row = prev[torch.randperm(K, generator=self.g)].clone()
                n_new = int(round(self.miss_rate * K))
                if n_new:
                    pos = torch.randperm(K, generator=self.g)[:n_new]
                    row[pos] = self._fresh(n_new)
            if 0 <= s < S:
                self.prev[s] = row.clone()
            row = row.clone()
            if self.dup_entries and K > 4:
                n = max(1, K // 64)
                a, b = self._rand(n, 0, K), self._rand(n, 0, K)
                row[a] = row[b]
            if self.pad_entries and K > 4:
                row[self._rand(max(1, K // 100), 0, K)] = -1
            if self.bad_keys and K > 8:
                bad = torch.tensor(
                    [self.num_keys, self.num_keys + 7, 2**31 - 1, -5, -(2**31)], dtype=I32
                )
                row[self._rand(len(bad), 0, K)] = bad
            top_k[r] = row
        resident = None
        if self.resident:
            resident = torch.full((B, K), -1, dtype=I32)
            mask = torch.rand(B, K, generator=self.g) < 0.1
            resident[mask] = self._rand(int(mask.sum()), 0, 1 << 20).to(I32)
        return top_k, state_rows, resident

    def forget(self, rows):
        for s in rows:
            self.prev.pop(int(s), None)


class Pair:
    """The same residency state on the CPU and on the CUDA device, stepped together."""

    def __init__(self, S, H, hot_base=0):
        self.S, self.H, self.hot_base = S, H, hot_base
        self.cpu = dict(
            slot_keys=torch.full((S, H), -1, dtype=I32),
            lru=torch.arange(H, dtype=torch.int16).repeat(S, 1),
            stats=torch.zeros(2, dtype=torch.uint64),
        )
        self.gpu = {k: v.to(DEV).clone() for k, v in self.cpu.items()}

    def resolve(self, top_k, state_rows, resident, num_keys):
        B, K = top_k.shape
        res = {}
        for side, st, dev in (("cpu", self.cpu, "cpu"), ("gpu", self.gpu, DEV)):
            out = torch.full((B, K), -7, dtype=I32, device=dev)
            src = torch.full((B, K), -7, dtype=I32, device=dev)
            dst = torch.full((B, K), -7, dtype=I32, device=dev)
            cnt = torch.full((B,), -7, dtype=I32, device=dev)
            ops.resolve_residency(
                top_k.to(dev),
                state_rows.to(dev),
                st["slot_keys"],
                st["lru"],
                st["stats"],
                out,
                src,
                dst,
                cnt,
                num_keys=num_keys,
                hot_base=self.hot_base,
                resident_rows=None if resident is None else resident.to(dev),
            )
            res[side] = (out, src, dst, cnt)
        return res

    def invalidate(self, state_rows, keys=None):
        ops.invalidate(self.cpu["slot_keys"], self.cpu["lru"], state_rows, keys)
        ops.invalidate(
            self.gpu["slot_keys"],
            self.gpu["lru"],
            state_rows.to(DEV),
            None if keys is None else keys.to(DEV),
        )

    def assert_equal(self, what=""):
        torch.cuda.synchronize()
        for k in ("slot_keys", "lru", "stats"):
            a, b = self.cpu[k], self.gpu[k].cpu()
            if a.dtype == torch.uint64:  # few ops support uint64: compare as lists
                if a.tolist() != b.tolist():
                    raise AssertionError(f"{what}: {k} differs: {a.tolist()} vs {b.tolist()}")
            elif not torch.equal(a, b):
                raise AssertionError(
                    f"{what}: {k} differs, first at {(a != b).nonzero()[:5].tolist()}"
                )


def assert_plan_equal(res, what=""):
    names = ("out_rows", "miss_src", "miss_dst", "miss_count")
    for name, a, b in zip(names, res["cpu"], res["gpu"]):
        b = b.cpu()
        if not torch.equal(a, b):
            idx = (a != b).nonzero()[:5].tolist()
            raise AssertionError(
                f"{what}: {name} differs at {idx}: cpu {a[tuple(zip(*idx))]} "
                f"gpu {b[tuple(zip(*idx))]}"
            )


def churn_state(pair, trace, g, num_keys):
    """State-row reuse: reset a few rows, drop a few (row, key) pairs, with bad entries mixed in."""
    S = pair.S
    rows = torch.randint(-2, S + 2, (max(2, S // 20),), generator=g, dtype=torch.int64).to(I32)
    pair.invalidate(rows)
    trace.forget(rows.tolist())
    n = max(4, S // 4)
    krows = torch.randint(-1, S + 1, (n,), generator=g, dtype=torch.int64).to(I32)
    held = pair.cpu["slot_keys"][
        krows.clamp(0, S - 1).long(), torch.randint(0, pair.H, (n,), generator=g)
    ]
    keys = torch.where(
        torch.rand(n, generator=g) < 0.7,
        held,
        torch.randint(-1, num_keys, (n,), generator=g, dtype=torch.int64).to(I32),
    )
    pair.invalidate(krows, keys)


# --------------------------------------------------------------------------------------------
# resolve + invalidate, bit for bit
# --------------------------------------------------------------------------------------------

RESOLVE_CONFIGS = [
    # B, K, H, S, miss_rate, resident, hot_base, steps
    (256, 2048, 4096, 300, 0.05, False, 0, 4),
    (64, 2048, 4096, 80, 0.20, True, 12345, 4),
    (8, 2048, 2048, 8, 0.30, False, 0, 4),  # K == H: every slot turns over
    (33, 300, 777, 40, 0.10, True, 3, 5),  # odd sizes, more than one scan tile of LRU
    (5, 7, 13, 6, 0.40, True, 0, 6),  # tiny
    (4, 2048, 32768, 6, 0.05, False, 0, 3),  # largest hot buffer (global workspace)
    (70, 2048, 4096, 80, 0.20, True, 0, 3),  # batch up to the SM count: wide CTAs
    (3, 9000, 9000, 4, 0.10, True, 0, 3),  # too big for shared memory: global workspace
]


@pytest.mark.parametrize(
    "B,K,H,S,miss_rate,resident,hot_base,steps",
    RESOLVE_CONFIGS,
    ids=[f"B{c[0]}-K{c[1]}-H{c[2]}" + ("-res" if c[5] else "") for c in RESOLVE_CONFIGS],
)
def test_resolve_and_invalidate_match_cpu(B, K, H, S, miss_rate, resident, hot_base, steps):
    num_keys = max(4 * H, 1000)
    trace = Trace(
        B=B, K=K, S=S, num_keys=num_keys, miss_rate=miss_rate, seed=B * 7 + K, resident=resident
    )
    pair = Pair(S, H, hot_base)
    g = torch.Generator().manual_seed(99)
    for step in range(steps):
        top_k, state_rows, res = trace.step()
        out = pair.resolve(top_k, state_rows, res, num_keys)
        assert_plan_equal(out, f"step {step}")
        pair.assert_equal(f"step {step}")
        if step % 2 == 1:
            churn_state(pair, trace, g, num_keys)
            pair.assert_equal(f"step {step} after invalidate")
    # the counters moved and agree
    assert pair.cpu["stats"].tolist()[1] > 0


def test_resolve_hash_collisions_and_duplicate_holders():
    """Keys that collide in any power-of-two hash, and a state holding a key twice."""
    K, H, S = 64, 128, 2
    pair = Pair(S, H)
    keys = (torch.arange(K, dtype=torch.int64) * (1 << 20)).to(I32)  # same low bits
    top_k = torch.stack([keys, keys.flip(0)])
    num_keys = 2**31 - 1
    # a key held by two slots: the lowest slot is the hit slot, the other one is evictable
    for st in (pair.cpu, pair.gpu):
        st["slot_keys"][0, 5] = int(keys[3])
        st["slot_keys"][0, 90] = int(keys[3])
        st["slot_keys"][1, 7] = int(keys[9])
    out = pair.resolve(top_k, torch.tensor([0, 1], dtype=I32), None, num_keys)
    assert_plan_equal(out)
    pair.assert_equal()
    out = pair.resolve(
        top_k[:, : K // 2].contiguous().repeat(1, 2),
        torch.tensor([1, 0], dtype=I32),
        None,
        num_keys,
    )
    assert_plan_equal(out)
    pair.assert_equal()


def test_resolve_corrupted_lru_is_memory_safe_and_matches_cpu():
    pair = Pair(2, 4)
    for st in (pair.cpu, pair.gpu):
        st["lru"][0] = torch.tensor([30000, -5, 2, 3], dtype=torch.int16)
    out = pair.resolve(
        torch.tensor([[5, 6, 7, 8]], dtype=I32), torch.tensor([0], dtype=I32), None, 10
    )
    assert_plan_equal(out)
    pair.assert_equal()
    assert out["gpu"][3].tolist() == [2]


@pytest.mark.parametrize(
    "B,K,H",
    [(1, 64, 128), (1, 2048, 4096), (140, 2048, 4096), (1, 300, 5000), (2, 9000, 9100)],
    ids=["fused-small", "fused-wide", "fused-512", "tiled", "workspace"],
)
def test_resolve_slot_missing_from_a_corrupted_lru_is_never_a_hit_slot(B, K, H):
    """Every resolve path finds hits only among the slots the LRU order lists."""
    pair = Pair(B, H)
    num_keys = 2**31 - 1
    g = torch.Generator().manual_seed(K)
    top_k = torch.randint(0, 1 << 30, (B, K), generator=g, dtype=torch.int64).to(I32)
    rows = torch.arange(B, dtype=I32)
    pair.resolve(top_k, rows, None, num_keys)  # all misses: key i of a row lands in slot i
    for st in (pair.cpu, pair.gpu):
        lru = st["lru"]
        lru[lru == 3] = 5  # slot 3 (holding key 3) unlisted, slot 5 listed twice
        st["slot_keys"][:, K + 1] = top_k[:, 7].to(st["slot_keys"].device)  # two holders of key 7
    out = pair.resolve(top_k, rows, None, num_keys)
    assert_plan_equal(out)
    pair.assert_equal()
    _, src, _, cnt = (t.cpu() for t in out["gpu"])
    assert cnt.tolist() == [1] * B  # key 3 misses; key 7 hits its lowest holder
    assert src[:, 0].tolist() == top_k[:, 3].tolist()
    assert out["gpu"][0][:, 7].cpu().tolist() == [s * H + 7 for s in range(B)]


def test_resolve_empty_batch_and_all_padding():
    pair = Pair(3, 16)
    out = pair.resolve(torch.empty(0, 8, dtype=I32), torch.empty(0, dtype=I32), None, 100)
    assert_plan_equal(out)
    out = pair.resolve(
        torch.full((4, 8), -1, dtype=I32), torch.tensor([-1, 3, 0, 0], dtype=I32), None, 100
    )
    assert_plan_equal(out)
    pair.assert_equal()


# --------------------------------------------------------------------------------------------
# gather, bit for bit
# --------------------------------------------------------------------------------------------


def _pinned(nbytes, g):
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    t.copy_(torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8))
    return t


def _host_views(raw, L, rows, row_bytes, block_size):
    """Layer-interleaved packing: [blocks, L, block_size, row_bytes]; layer l is a strided view."""
    blocks = rows // block_size
    packed = raw[: blocks * L * block_size * row_bytes].view(blocks, L, block_size, row_bytes)
    return [packed[:, l] for l in range(L)]


GATHER_CONFIGS = [
    # B, K, H, S, L, row_bytes, block_size, miss_rate, steps
    (64, 2048, 4096, 72, 4, 1152, 64, 0.05, 3),
    (256, 2048, 4096, 260, 1, 656, 1, 0.001, 3),
    (16, 512, 1024, 20, 4, 656, 16, 0.2, 3),
]


@pytest.mark.parametrize(
    "B,K,H,S,L,row_bytes,block_size,miss_rate,steps",
    GATHER_CONFIGS,
    ids=[f"B{c[0]}-L{c[4]}-{c[5]}B" for c in GATHER_CONFIGS],
)
def test_gather_matches_cpu(B, K, H, S, L, row_bytes, block_size, miss_rate, steps):
    g = torch.Generator().manual_seed(L * 1000 + row_bytes)
    num_keys = 32 * H  # a multiple of every block_size used here
    raw = _pinned(num_keys * L * row_bytes, g)
    host = _host_views(raw, L, num_keys, row_bytes, block_size)
    hot_base = 64
    hot_rows = hot_base + S * H + 32
    hot_cpu = [torch.zeros(hot_rows, row_bytes, dtype=torch.uint8) for _ in range(L)]
    hot_gpu = [h.to(DEV).clone() for h in hot_cpu]
    moved_cpu = torch.zeros(1, dtype=torch.uint64)
    moved_gpu = torch.zeros(1, dtype=torch.uint64, device=DEV)
    trace = Trace(B=B, K=K, S=S, num_keys=num_keys + 50, miss_rate=miss_rate, seed=5)
    pair = Pair(S, H, hot_base)
    for step in range(steps):
        top_k, state_rows, _ = trace.step()
        # keys in [num_keys, num_keys + 50) are valid for resolve but past the host view:
        # gather must skip them and not count their bytes
        res = pair.resolve(top_k, state_rows, None, num_keys + 50)
        assert_plan_equal(res, f"step {step}")
        out, src, dst, cnt = res["cpu"]
        # plan edits the kernel must survive: a destination out of range, a count past K
        src_g, dst_g, cnt_g = (t.clone() for t in res["gpu"][1:])
        if B > 2:
            dst[1, 0] = hot_rows + 5
            dst_g[1, 0] = hot_rows + 5
            cnt[2] = K + 100
            cnt_g[2] = K + 100
        ops.gather(host, hot_cpu, src, dst, cnt, moved_cpu)
        ops.gather(host, hot_gpu, src_g, dst_g, cnt_g, moved_gpu)
        torch.cuda.synchronize()
        for l in range(L):
            assert torch.equal(hot_cpu[l], hot_gpu[l].cpu()), f"step {step} layer {l}"
        assert moved_cpu.tolist() == moved_gpu.cpu().tolist(), f"step {step} moved bytes"
        pair.assert_equal(f"step {step}")
    assert moved_cpu.tolist()[0] > 0


def test_gather_host_on_device_and_registered_host_memory():
    """Host views may also live on the same CUDA device, or in cudaHostRegister'd memory."""
    g = torch.Generator().manual_seed(3)
    rows, row_bytes, K = 5000, 656, 300
    host_cpu = torch.randint(0, 256, (rows, row_bytes), generator=g, dtype=torch.uint8)
    registered = host_cpu.clone()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(registered.data_ptr(), registered.numel(), 0)
    assert int(err) == 0
    try:
        assert registered.is_pinned()
        src = torch.randint(-3, rows + 3, (2, K), generator=g, dtype=torch.int64).to(I32)
        # distinct destinations (as in a real plan), a few of them out of range
        dst = (torch.randperm(4006, generator=g)[: 2 * K] - 3).to(I32).view(2, K)
        cnt = torch.tensor([K, K // 2], dtype=I32)
        ref = [torch.zeros(4000, row_bytes, dtype=torch.uint8)]
        moved_ref = torch.zeros(1, dtype=torch.uint64)
        ops.gather([host_cpu], ref, src, dst, cnt, moved_ref)
        for host in (host_cpu.to(DEV), registered):
            hot = [torch.zeros(4000, row_bytes, dtype=torch.uint8, device=DEV)]
            moved = torch.zeros(1, dtype=torch.uint64, device=DEV)
            ops.gather([host], hot, src.to(DEV), dst.to(DEV), cnt.to(DEV), moved)
            torch.cuda.synchronize()
            assert torch.equal(hot[0].cpu(), ref[0])
            assert moved.cpu().tolist() == moved_ref.tolist()
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(registered.data_ptr())


_CAPPED_GATHER = """
import torch
from hisparse import ops
g = torch.Generator().manual_seed(5)
host = torch.randint(0, 256, (20000, 656), generator=g, dtype=torch.uint8).pin_memory()
src = torch.randint(0, 20000, (64, 512), generator=g, dtype=torch.int64).to(torch.int32)
dst = torch.randperm(64 * 512, generator=g).to(torch.int32).view(64, 512)
cnt = torch.randint(0, 513, (64,), generator=g, dtype=torch.int64).to(torch.int32)
ref = [torch.zeros(64 * 512, 656, dtype=torch.uint8)]
ops.gather([host], ref, src, dst, cnt)
hot = [torch.zeros(64 * 512, 656, dtype=torch.uint8, device="cuda")]
ops.gather([host], hot, src.cuda(), dst.cuda(), cnt.cuda())
torch.cuda.synchronize()
assert torch.equal(hot[0].cpu(), ref[0])
print("equal")
"""


@pytest.mark.parametrize("ctas, ok", [("1", True), ("0", True), ("", True), ("64x", False)])
def test_gather_over_pcie_with_any_cta_cap(ctas, ok):
    """HISPARSE_PCIE_COPY_CTAS: one CTA, no cap and the default copy the same rows; a value
    that is not a whole number is refused by name (read once per process: a child each)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, HISPARSE_PCIE_COPY_CTAS=ctas)
    run = subprocess.run(
        [sys.executable, "-c", _CAPPED_GATHER], env=env, capture_output=True, text=True, timeout=120
    )
    if ok:
        assert run.returncode == 0 and run.stdout.split() == ["equal"], run.stderr[-2000:]
    else:
        assert run.returncode != 0
        assert "HISPARSE_PCIE_COPY_CTAS must be a whole number" in run.stderr, run.stderr[-2000:]


def test_gather_many_layers_one_call():
    """Any number of layers per call (the CUDA backend splits into launches of 64)."""
    g = torch.Generator().manual_seed(4)
    L, rows, row_bytes = 130, 256, 32
    raw = _pinned(L * rows * row_bytes, g)
    host = [
        raw[l * rows * row_bytes : (l + 1) * rows * row_bytes].view(rows, row_bytes)
        for l in range(L)
    ]
    src = torch.randint(0, rows, (3, 40), generator=g, dtype=torch.int64).to(I32)
    dst = torch.randperm(512, generator=g)[:120].to(I32).view(3, 40)  # distinct, as in a plan
    cnt = torch.tensor([40, 0, 17], dtype=I32)
    hot_cpu = [torch.zeros(512, row_bytes, dtype=torch.uint8) for _ in range(L)]
    hot_gpu = [h.to(DEV).clone() for h in hot_cpu]
    mc, mg = torch.zeros(1, dtype=torch.uint64), torch.zeros(1, dtype=torch.uint64, device=DEV)
    ops.gather(host, hot_cpu, src, dst, cnt, mc)
    ops.gather(host, hot_gpu, src.to(DEV), dst.to(DEV), cnt.to(DEV), mg)
    torch.cuda.synchronize()
    for a, b in zip(hot_cpu, hot_gpu):
        assert torch.equal(a, b.cpu())
    assert mc.tolist() == mg.cpu().tolist() == [57 * L * row_bytes]


def _process_cudart():
    """The CUDA runtime library this process (torch and hisparse._C) uses, through ctypes."""
    import ctypes

    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    if not paths:
        return None
    return ctypes.CDLL(sorted(paths)[0])


def test_gather_does_not_swallow_an_unrelated_pending_cuda_error():
    rt = _process_cudart()
    if rt is None:
        pytest.skip("CUDA runtime linked statically")
    host = [torch.zeros(64, 32, dtype=torch.uint8).pin_memory()]
    hot = [torch.zeros(64, 32, dtype=torch.uint8, device=DEV)]
    plan = torch.zeros(1, 4, dtype=I32, device=DEV)
    cnt = torch.ones(1, dtype=I32, device=DEV)
    torch.cuda.synchronize()
    rt.cudaGetLastError()
    assert rt.cudaSetDevice(1 << 20) != 0  # leaves a (non-sticky) error pending
    pending = rt.cudaPeekAtLastError()
    assert pending != 0
    try:
        ops.gather(host, hot, plan, plan, cnt)
        raised = False
    except Exception:  # the launch check reported it: surfaced, not swallowed
        raised = True
    try:
        assert raised or rt.cudaPeekAtLastError() == pending
    finally:
        rt.cudaGetLastError()


# --------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K,H,L", [(2048, 4096, 4), (9000, 9000, 1)], ids=["smem", "workspace"])
def test_graph_capture_replay_equals_eager(K, H, L):
    B, S, row_bytes = 16 if K <= 4096 else 2, 20 if K <= 4096 else 3, 656
    num_keys = 4 * H
    g = torch.Generator().manual_seed(11)
    raw = _pinned(num_keys * L * row_bytes, g)
    host = _host_views(raw, L, num_keys, row_bytes, 1)
    hot_rows = S * H
    trace = Trace(B=B, K=K, S=S, num_keys=num_keys, miss_rate=0.1, seed=2, resident=True)

    def fresh():
        return dict(
            slot_keys=torch.full((S, H), -1, dtype=I32, device=DEV),
            lru=torch.arange(H, dtype=torch.int16, device=DEV).repeat(S, 1),
            counters=torch.zeros(3, dtype=torch.uint64, device=DEV),
            hot=[torch.zeros(hot_rows, row_bytes, dtype=torch.uint8, device=DEV) for _ in range(L)],
            out=torch.full((B, K), -7, dtype=I32, device=DEV),
            src=torch.full((B, K), -7, dtype=I32, device=DEV),
            dst=torch.full((B, K), -7, dtype=I32, device=DEV),
            cnt=torch.full((B,), -7, dtype=I32, device=DEV),
        )

    def step(st, top_k, rows, res):
        ops.resolve_residency(
            top_k,
            rows,
            st["slot_keys"],
            st["lru"],
            st["counters"][0:2],
            st["out"],
            st["src"],
            st["dst"],
            st["cnt"],
            num_keys=num_keys,
            hot_base=0,
            resident_rows=res,
        )
        ops.gather(host, st["hot"], st["src"], st["dst"], st["cnt"], st["counters"][2:3])

    eager, graphed = fresh(), fresh()
    static_top_k = torch.full((B, K), -1, dtype=I32, device=DEV)
    static_rows = torch.full((B,), -1, dtype=I32, device=DEV)
    static_res = torch.full((B, K), -1, dtype=I32, device=DEV)
    # warm up on a side stream (as torch recommends), with padding inputs that change nothing
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(graphed, static_top_k, static_rows, static_res)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed, static_top_k, static_rows, static_res)
    step(eager, static_top_k, static_rows, static_res)  # keep the two sides in lockstep
    for i in range(4):
        top_k, rows, res = trace.step()
        static_top_k.copy_(top_k)
        static_rows.copy_(rows)
        static_res.copy_(res)
        graph.replay()
        step(eager, top_k.to(DEV), rows.to(DEV), res.to(DEV))
        torch.cuda.synchronize()
        assert eager["counters"].tolist() == graphed["counters"].tolist(), f"replay {i}"
        for k in ("slot_keys", "lru", "out", "src", "dst", "cnt"):
            assert torch.equal(eager[k], graphed[k]), f"replay {i}: {k}"
        for a, b in zip(eager["hot"], graphed["hot"]):
            assert torch.equal(a, b), f"replay {i}: hot"
        if i == 1:  # state-row reuse between replays
            rows_to_reset = torch.tensor([0, 2], dtype=I32, device=DEV)
            for st in (eager, graphed):
                ops.invalidate(st["slot_keys"], st["lru"], rows_to_reset)
            trace.forget([0, 2])
    counters = graphed["counters"].tolist()
    assert counters[1] > 0 and counters[2] > 0
