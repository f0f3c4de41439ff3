"""hisparse_topk_slots against the Python oracle (tests/oracle.py) on every built backend, the
CUDA kernel against the CPU one bit for bit, its argument checks and its fake kernel."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from hisparse import ops
from tests import oracle
from tests.devices import needs_cuda

NEG = float("-inf")


def _case(T, L, K, bs, *, seed=0, ties=False, masked=False, req_dtype=torch.int64,
          bt_dtype=torch.int32, bad_req=False):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    if ties:  # ReLU-like scores: many exact zeros, a few repeated values
        s = torch.randint(-3, 4, (T, L), generator=g).float().clamp(min=0)
        s[s == 0] = torch.where(torch.rand(int((s == 0).sum()), generator=g) < 0.5, 0.0, -0.0)
    else:
        s = torch.randn(T, L, generator=g)
    if masked:  # each token sees only its own prefix, as the indexer masks past its position
        pos = torch.randint(0, L, (T,), generator=g)
        s[torch.arange(L)[None, :] > pos[:, None]] = NEG
        s[0, 0] = float("nan")  # never selected
    R = T + 2
    W = -(-L // bs)
    bt = torch.randperm(R * W * 3, generator=g)[: R * W].view(R, W).to(bt_dtype)
    req = torch.randint(0, R, (T,), generator=g)
    if bad_req and T:
        req[0] = R
        req[-1] = -1
    return s, req.to(req_dtype), bt, bs, K


def _run(device, s, req, bt, bs, K):
    out = torch.full((s.shape[0], K), 7, dtype=torch.int64, device=device)
    ops.topk_slots(s.to(device), req.to(device), bt.to(device), bs, out)
    return out.cpu()


def _want(s, req, bt, bs, K):
    return torch.tensor(
        oracle.topk_slots(s.tolist(), req.tolist(), bt.tolist(), bs, K), dtype=torch.int64
    ).view(s.shape[0], K)


CASES = [
    dict(T=3, L=50, K=8, bs=4),
    dict(T=2, L=33, K=64, bs=8),  # K > L: every candidate, then -1
    dict(T=4, L=300, K=40, bs=16, ties=True),
    dict(T=5, L=257, K=32, bs=1, masked=True),
    dict(T=3, L=1000, K=100, bs=64, ties=True, masked=True, req_dtype=torch.int32),
    dict(T=2, L=70, K=10, bs=7, bt_dtype=torch.int64, bad_req=True),
    dict(T=0, L=16, K=4, bs=4),
    dict(T=2, L=0, K=4, bs=4),
    dict(T=2, L=16, K=0, bs=4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_matches_oracle(device, case):
    args = _case(**case)
    assert torch.equal(_run(device, *args), _want(*args))


def test_ties_take_the_lowest_positions(device):
    s = torch.zeros(1, 10)
    s[0, 7] = 1.0
    s[0, 3] = -0.0  # equal to +0.0
    bt = torch.arange(10, dtype=torch.int32).view(1, 10)
    got = _run(device, s, torch.zeros(1, dtype=torch.int64), bt, 1, 4)
    assert got.tolist() == [[0, 1, 2, 7]]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("L,K", [(4096, 2048), (32768, 2048), (131072, 2048), (5000, 2048)])
@pytest.mark.parametrize("ties", [False, True])
def test_cuda_equals_cpu(L, K, ties):
    args = _case(T=6, L=L, K=K, bs=64, seed=L, ties=ties, masked=True)
    assert torch.equal(_run("cuda", *args), _run("cpu", *args))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "T,L,masked",
    [(1, 2047, False), (1, 20000, True), (1, 131072, False), (2, 131072, True), (3, 400000, False),
     (200, 9000, True)],
)  # fmt: skip
def test_cuda_slices_equal_cpu(T, L, masked):
    """A row split over a cluster of CTAs (up to eight slices while the batch leaves
    multiprocessors idle; past 384k scores each slice is read from global memory at every pass)
    selects and orders what one CTA does: ties across slices go to the lowest positions."""
    args = _case(T=T, L=L, K=2048, bs=64, seed=T + L, ties=True, masked=masked)
    assert torch.equal(_run("cuda", *args), _run("cpu", *args))


@pytest.mark.cuda
@needs_cuda
def test_cuda_one_value_over_every_slice():
    s = torch.zeros(2, 40000)
    s[1, 39999] = 1.0
    bt = torch.arange(2 * 625, dtype=torch.int32).view(2, 625)
    got = _run("cuda", s, torch.tensor([0, 1]), bt, 64, 2048)
    assert got[0].tolist() == list(range(2048))
    assert got[1].tolist() == list(range(625 * 64, 625 * 64 + 2047)) + [625 * 64 + 39999]


@pytest.mark.cuda
@needs_cuda
def test_cuda_same_set_as_topk():
    """Without ties the kernel selects what ``torch.topk`` does (the core's former path)."""
    s, req, bt, bs, K = _case(T=8, L=32768, K=2048, bs=64, seed=3, masked=True)
    s[0, 0] = 1.0  # no NaN: topk ranks it first, the op never selects it
    got = _run("cuda", s, req, bt, bs, K)
    best, idx = s.cuda().topk(K, dim=-1)
    pos = torch.where(best > NEG, idx, torch.full_like(idx, -1)).cpu()
    for t in range(s.shape[0]):
        p = pos[t][pos[t] >= 0].sort().values
        r = int(req[t])
        want = bt[r][p // bs].long() * bs + p % bs
        assert torch.equal(got[t, : len(want)], want)
        assert (got[t, len(want) :] == -1).all()


def _valid_args():
    s, req, bt, bs, K = _case(T=2, L=16, K=4, bs=4)
    return [s, req, bt, bs, torch.zeros(2, K, dtype=torch.int64)]


@pytest.mark.parametrize(
    "at,value,message",
    [
        (0, torch.zeros(2, 16, dtype=torch.float64), "argument 'scores' must be torch.float32"),
        (1, torch.zeros(3, dtype=torch.int64), "argument 'req' must have shape"),
        (1, torch.zeros(2, dtype=torch.int16), "argument 'req' must be torch.int32 or torch.int64"),
        (2, torch.zeros(4, 3, dtype=torch.int32), "argument 'scores' has 16 positions"),
        (3, 0, "argument 'block_size' must be in [1, 2^31-1]"),
        (3, True, "argument 'block_size'"),
        (4, torch.zeros(3, 4, dtype=torch.int64), "argument 'out' must have 2 rows"),
        (4, torch.zeros(2, 4, dtype=torch.int32), "argument 'out' must be torch.int64"),
    ],
)
def test_bad_arguments_are_named(device, at, value, message):
    args = _valid_args()
    args[at] = value
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
    out_before = args[4].clone() if isinstance(args[4], torch.Tensor) else None
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("^", r"\^")):
        ops.topk_slots(*args)
    if out_before is not None:
        assert torch.equal(args[4], out_before)  # nothing written


def test_fake_kernel_traces_and_refuses_mixed_devices():
    s, req, bt, bs, out = _valid_args()
    with FakeTensorMode() as mode:
        fs, freq, fbt, fout = (mode.from_tensor(t) for t in (s, req, bt, out))
        torch.ops.hisparse.hisparse_topk_slots(fs, freq, fbt, bs, fout)
    with pytest.raises(RuntimeError, match="argument 'out' must be on meta"):
        torch.ops.hisparse.hisparse_topk_slots(s.to("meta"), req.to("meta"), bt.to("meta"), bs, out)


@pytest.mark.parametrize("pad", [3, 4])  # the CUDA kernel's scalar and 16-byte loads
@pytest.mark.parametrize("L", [200, 60000])  # rows it keeps in shared memory, and longer ones
def test_rows_inside_a_wider_buffer(device, pad, L):
    s, req, bt, bs, K = _case(T=3, L=L, K=64, bs=16, seed=pad, ties=True, masked=True)
    wide = torch.full((3, L + pad), 5.0)
    wide[:, :L] = s  # the columns past L score highest: selecting any of them is a bug
    got = _run(device, wide[:, :L], req, bt, bs, K)
    assert torch.equal(got, _want(s, req, bt, bs, K))


def test_rows_must_be_contiguous(device):
    s, req, bt, bs, out = _valid_args()
    with pytest.raises(RuntimeError, match="argument 'scores' must have contiguous rows"):
        ops.topk_slots(s.t().contiguous().t().to(device), req.to(device), bt.to(device), bs,
                       out.to(device))  # fmt: skip
