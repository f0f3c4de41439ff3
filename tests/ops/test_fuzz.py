"""Seeded op fuzzer: random valid calls checked against the oracle, and random malformed calls
(shapes, dtypes, devices, strides, offsets, ranges). A malformed call must raise the op's named
error before touching anything; a call that is only out of range must follow the documented
padding rules bit for bit. Every case is reproducible from (seed, index) in the failure message.
"""

from __future__ import annotations

import random

import pytest
import torch

from hisparse import ops
from tests import oracle
from tests.helpers import RESOLVE_TENSOR_ARGS

CALLS_PER_SEED = 250
SEEDS = [11, 23, 37, 59]
ARG_ERROR = r"argument"


# ---- tensor helpers ---------------------------------------------------------------------------


def _i32(rows, shape):
    return torch.tensor(rows, dtype=torch.int32).reshape(shape)


def _offset_view(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """The same values in a view that starts inside a larger allocation (legal for index
    tensors)."""
    pad = rng.randint(1, 7)
    buf = torch.full((t.numel() + pad,), -99, dtype=t.dtype)
    v = buf[pad:].view(t.shape)
    v.copy_(t)
    return v


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 1:
        buf = torch.zeros(max(1, t.numel()) * 2, dtype=t.dtype)
        v = buf[::2][: t.numel()]
        v.copy_(t)
        return v
    v = torch.zeros(t.shape[1], t.shape[0], dtype=t.dtype).t()
    v.copy_(t)
    return v


def _other_dtype(t: torch.Tensor, rng: random.Random) -> torch.Tensor:
    choices = [
        d
        for d in (torch.int32, torch.int64, torch.int16, torch.uint8, torch.float32, torch.uint64)
        if d != t.dtype
    ]
    return t.to(rng.choice(choices))


def _snapshot(args):
    out = []
    for a in args:
        if isinstance(a, torch.Tensor) and a.device.type != "meta":
            out.append(a.clone())
        elif isinstance(a, list):
            out.append([t.clone() if t.device.type != "meta" else None for t in a])
        else:
            out.append(None)
    return out


def _unchanged(args, snap):
    for a, s in zip(args, snap):
        if s is None:
            continue
        if isinstance(a, list):
            if not all(x is None or torch.equal(t, x) for t, x in zip(a, s)):
                return False
        elif not torch.equal(a, s):
            return False
    return True


def _expect_named_error(op_name, call, args, fragment, where):
    """The op's own RuntimeError, naming an argument (and ``fragment``), before any write."""
    snap = _snapshot(args)
    with pytest.raises(RuntimeError, match=ARG_ERROR) as err:
        call()
    msg = str(err.value)
    assert msg.startswith(op_name), (where, msg)
    assert fragment in msg, (where, fragment, msg)
    assert _unchanged(args, snap), where


# ---- generic malformations ---------------------------------------------------------------------


def _break_tensor(t: torch.Tensor, rng: random.Random):
    """One way to make a tensor argument invalid for any op: returns (tensor, how)."""
    how = rng.choice(["dtype", "rank", "shape", "stride", "meta", "none"])
    if how == "dtype":
        return _other_dtype(t, rng), how
    if how == "rank":
        return (t.reshape(-1) if t.dim() == 2 else t.reshape(1, -1, 1)), how
    if how == "shape":
        shape = list(t.shape)
        shape[rng.randrange(len(shape))] += rng.choice([1, 2])
        return torch.zeros(shape, dtype=t.dtype), how
    if how == "stride":
        if t.numel() < 2 or (t.dim() == 2 and 1 in t.shape):
            return _other_dtype(t, rng), "dtype"
        return _non_contiguous(t), how
    if how == "meta":
        return t.to("meta"), how
    return None, how


# ---- resolve -----------------------------------------------------------------------------------


def _valid_state(rng, S, H, num_keys):
    slot_keys, lru = [], []
    for _ in range(S):
        pool = list(range(num_keys))
        rng.shuffle(pool)
        row = [pool.pop() if pool and rng.random() < 0.6 else -1 for _ in range(H)]
        slot_keys.append(row)
        perm = list(range(H))
        rng.shuffle(perm)
        lru.append(perm)
    return slot_keys, lru


def _resolve_case(rng):
    S, H = rng.randint(1, 4), rng.choice([1, 2, 4, 8, 16])
    K, B = rng.randint(1, H), rng.randint(1, 4)
    num_keys, hot_base = rng.randint(0, 40), rng.randint(0, 64)
    slot_keys, lru = _valid_state(rng, S, H, num_keys)
    # Keys and state rows range past both ends: -1 padding, out-of-range keys, duplicate rows.
    top_k = [[rng.randint(-3, num_keys + 3) for _ in range(K)] for _ in range(B)]
    state_rows = [rng.randint(-2, S) for _ in range(B)]
    resident = None
    if rng.random() < 0.3:
        resident = [[rng.choice([-1, -1, rng.randint(0, 500)]) for _ in range(K)] for _ in range(B)]
    return S, H, K, B, num_keys, hot_base, slot_keys, lru, top_k, state_rows, resident


def _resolve_tensors(case):
    S, H, K, B, num_keys, hot_base, slot_keys, lru, top_k, state_rows, resident = case
    return [
        _i32(top_k, (B, K)),
        _i32(state_rows, (B,)),
        None if resident is None else _i32(resident, (B, K)),
        _i32(slot_keys, (S, H)),
        torch.tensor(lru, dtype=torch.int16).reshape(S, H),
        torch.tensor([5, 7], dtype=torch.uint64),
        torch.full((B, K), -7, dtype=torch.int32),
        torch.full((B, K), -7, dtype=torch.int32),
        torch.full((B, K), -7, dtype=torch.int32),
        torch.full((B,), -7, dtype=torch.int32),
        num_keys,
        hot_base,
    ]


def _check_resolve_against_oracle(case, t, where):
    S, H, K, B, num_keys, hot_base, slot_keys, lru, top_k, state_rows, resident = case
    o_keys = [list(r) for r in slot_keys]
    o_lru = [list(r) for r in lru]
    o_stats = [5, 7]
    out, src, dst, cnt = oracle.resolve(
        top_k,
        state_rows,
        o_keys,
        o_lru,
        o_stats,
        num_keys=num_keys,
        hot_base=hot_base,
        resident_rows=resident,
    )
    assert t[6].tolist() == out, where
    assert t[9].tolist() == cnt, where
    for r in range(B):
        assert t[7][r, : cnt[r]].tolist() == src[r], where
        assert t[8][r, : cnt[r]].tolist() == dst[r], where
    assert t[3].tolist() == o_keys and t[4].tolist() == o_lru, where
    assert [int(x) for x in t[5].tolist()] == o_stats, where


def _call_resolve(t):
    ops.resolve_residency(
        t[0],
        t[1],
        t[3],
        t[4],
        t[5],
        t[6],
        t[7],
        t[8],
        t[9],
        num_keys=t[10],
        hot_base=t[11],
        resident_rows=t[2],
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_resolve(seed):
    rng = random.Random(seed)
    errors = valid = 0
    for n in range(CALLS_PER_SEED):
        where = f"seed {seed} call {n}"
        case = _resolve_case(rng)
        t = _resolve_tensors(case)
        mutation = rng.random()
        expect_name = None
        if mutation < 0.15:  # legal: index tensors as offset views into larger allocations
            for i in (0, 1, 2, 6, 7, 8, 9):
                if t[i] is not None and rng.random() < 0.5:
                    t[i] = _offset_view(t[i], rng)
        elif mutation < 0.75:
            choice = rng.randrange(13)
            if choice < 10:
                if t[choice] is None:
                    t[choice] = torch.zeros(1, dtype=torch.float64)
                    how = "dtype"
                else:
                    t[choice], how = _break_tensor(t[choice], rng)
                if how == "none" and choice == 2:
                    t[choice] = torch.zeros(1, 1, dtype=torch.float32)  # None is legal there
                expect_name = RESOLVE_TENSOR_ARGS[choice]
                if how in ("meta", "shape") and choice in (0, 3):
                    # top_k fixes B and K, slot_keys S and H: the error may name the other side
                    expect_name = ""
            elif choice == 10:
                t[10] = rng.choice([-1, -(2**40), 2**31, 2**62])
                expect_name = "num_keys"
            elif choice == 11:
                S, H = case[0], case[1]
                t[11] = rng.choice([-1, 2**31 - S * H + 1, 2**63 - 1])
                expect_name = "hot_base"
            else:  # K > H: top_k and every [B, K] buffer one column wider than the hot buffer
                S, H, K, B = case[:4]
                wide = H + 1
                t[0] = torch.zeros(B, wide, dtype=torch.int32)
                t[2] = None
                t[6], t[7], t[8] = (torch.zeros(B, wide, dtype=torch.int32) for _ in range(3))
                expect_name = "K <= H"
        if expect_name is None:
            _call_resolve(t)
            _check_resolve_against_oracle(case, t, where)
            valid += 1
            continue
        _expect_named_error(
            "hisparse_resolve_residency", lambda: _call_resolve(t), t, expect_name, where
        )
        errors += 1
    assert errors > CALLS_PER_SEED // 3 and valid > CALLS_PER_SEED // 4


# ---- gather ------------------------------------------------------------------------------------


def _row_view(rng, rows, row_bytes, *, fill):
    """A host/hot view: 2-D rows or 3-D blocks, possibly at a 16-aligned offset or strided
    wider than the row (both legal)."""
    pad_rows = rng.choice([0, 0, 1])
    stride = row_bytes + rng.choice([0, 0, 16])
    if rng.random() < 0.5 and rows % 2 == 0:
        blocks, bs = rows // 2, 2
        buf = torch.zeros(pad_rows * stride + blocks * bs * stride, dtype=torch.uint8)
        v = buf[pad_rows * stride :].as_strided((blocks, bs, row_bytes), (bs * stride, stride, 1))
    else:
        buf = torch.zeros(pad_rows * stride + rows * stride, dtype=torch.uint8)
        v = buf[pad_rows * stride :].as_strided((rows, row_bytes), (stride, 1))
    if fill:
        v.copy_(
            torch.randint(
                0,
                256,
                v.shape,
                dtype=torch.uint8,
                generator=torch.Generator().manual_seed(rng.randrange(2**31)),
            )
        )
    return v


def _flat_rows(v):
    return v.reshape(-1, v.shape[-1])


def _gather_case(rng):
    L, B, K = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 6)
    rb = [rng.choice([16, 32, 48]) for _ in range(L)]
    n_host, n_hot = rng.choice([4, 6, 8]), rng.choice([4, 6, 8])
    host = [_row_view(rng, n_host, rb[i], fill=True) for i in range(L)]
    hot = [_row_view(rng, n_hot, rb[i], fill=False) for i in range(L)]
    src = [[rng.randint(-2, n_host + 1) for _ in range(K)] for _ in range(B)]
    # Destinations are distinct in every plan resolve writes (the contract for gather).
    dsts = list(range(-3, n_hot + 3))
    rng.shuffle(dsts)
    picks = [d for d in dsts if not 0 <= d < n_hot][: B * K]
    inside = [d for d in dsts if 0 <= d < n_hot]
    pool = inside + picks
    rng.shuffle(pool)
    flat = (pool + [-1] * (B * K))[: B * K]
    dst = [flat[r * K : (r + 1) * K] for r in range(B)]
    cnt = [rng.randint(-2, K + 2) for _ in range(B)]
    return host, hot, src, dst, cnt


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_gather(seed):
    rng = random.Random(seed)
    errors = valid = 0
    for n in range(CALLS_PER_SEED):
        where = f"seed {seed} call {n}"
        host, hot, src, dst, cnt = _gather_case(rng)
        B, K = len(src), len(src[0])
        args = [
            list(host),
            list(hot),
            _i32(src, (B, K)),
            _i32(dst, (B, K)),
            _i32(cnt, (B,)),
            torch.zeros(1, dtype=torch.uint64),
        ]
        if rng.random() < 0.3:
            for i in (2, 3, 4):
                args[i] = _offset_view(args[i], rng)
        expect = None
        if rng.random() < 0.6:
            choice = rng.randrange(9)
            L = len(host)
            layer = rng.randrange(L)
            rb = host[layer].shape[-1]
            if choice < 4:  # plan tensors and moved_bytes
                args[2 + choice], how = _break_tensor(args[2 + choice], rng)
                if how == "none" and choice == 3:
                    args[5] = torch.zeros(2, dtype=torch.uint64)  # None is legal for moved_bytes
                    choice = 3
                expect = ["miss_src", "miss_dst", "miss_count", "moved_bytes"][choice]
                if how in ("meta", "shape") and choice == 0:
                    expect = ""  # miss_src fixes B and K for the other plan tensors
            elif choice == 4:  # a misaligned view: data pointer off the 16-byte grid
                side = rng.randrange(2)
                buf = torch.zeros(8 * rb + 16, dtype=torch.uint8)
                off = rng.choice([1, 4, 8, 15])
                args[side][layer] = buf[off : off + 8 * rb].view(8, rb)
                expect = f"{'host' if side == 0 else 'hot'}[{layer}]"
            elif choice == 5:  # row bytes not a multiple of 16, or mismatched host/hot rows
                if rng.random() < 0.5:
                    args[0][layer] = torch.zeros(8, rb + 8, dtype=torch.uint8)
                    expect = f"host[{layer}]"
                else:
                    args[1][layer] = torch.zeros(8, rb + 16, dtype=torch.uint8)
                    expect = "row size"
            elif choice == 6:  # last stride not 1, or a flat / 4-D view
                v = torch.zeros(8, 2 * rb, dtype=torch.uint8)
                args[1][layer] = rng.choice([v[:, ::2], v.reshape(-1), v.reshape(2, 2, 2, 2 * rb)])
                expect = f"hot[{layer}]"
            elif choice == 7:  # list lengths
                args[1] = args[1][:-1] if rng.random() < 0.5 else args[1] + [args[1][0]]
                if not args[1]:
                    args[0] = []
                expect = "" if not args[0] else "same length"
            else:  # dtype / device of one view
                side = rng.randrange(2)
                v = args[side][layer]
                args[side][layer] = v.to(torch.int16) if rng.random() < 0.5 else v.to("meta")
                expect = f"{'host' if side == 0 else 'hot'}[{layer}]"
        if expect is None:
            o_hot = [[bytes(r.tolist()) for r in _flat_rows(h)] for h in hot]
            moved = 0
            for li in range(len(host)):
                o_host = [bytes(r.tolist()) for r in _flat_rows(host[li])]
                moved += oracle.gather(o_host, o_hot[li], src, dst, cnt)
            ops.gather(*args)
            for li in range(len(host)):
                assert [bytes(r.tolist()) for r in _flat_rows(hot[li])] == o_hot[li], where
            assert int(args[5][0]) == moved, where
            valid += 1
            continue
        _expect_named_error("hisparse_gather", lambda: ops.gather(*args), args, expect, where)
        errors += 1
    assert errors > CALLS_PER_SEED // 3 and valid > CALLS_PER_SEED // 4


# ---- invalidate --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzz_invalidate(seed):
    rng = random.Random(seed)
    errors = valid = 0
    for n in range(CALLS_PER_SEED):
        where = f"seed {seed} call {n}"
        S, H, num_keys = rng.randint(1, 4), rng.choice([1, 4, 8]), rng.randint(1, 20)
        slot_keys, lru = _valid_state(rng, S, H, num_keys)
        N = rng.randint(0, 5)
        rows = [rng.randint(-2, S + 1) for _ in range(N)]
        keys = None if rng.random() < 0.4 else [rng.randint(-2, num_keys) for _ in range(N)]
        args = [
            _i32(slot_keys, (S, H)),
            torch.tensor(lru, dtype=torch.int16).reshape(S, H),
            _i32(rows, (N,)),
            None if keys is None else _i32(keys, (N,)),
        ]
        expect = None
        if rng.random() < 0.6:
            choice = rng.randrange(5)
            if choice < 4 and args[choice] is not None and args[choice].numel() > 0:
                args[choice], how = _break_tensor(args[choice], rng)
                expect = ["slot_keys", "lru", "state_rows", "keys"][choice]
                if how == "none" and choice == 3:
                    expect = None  # keys None is legal: a state-row reset
                    keys = None
                elif how == "shape" and choice == 2 and keys is None:
                    expect, rows = None, args[2].tolist()  # any N is legal without keys
                elif how in ("meta", "shape") and choice in (0, 2):
                    expect = ""  # slot_keys fixes S and H, state_rows N
            elif choice == 4:
                args[0] = torch.full((S, 40000), -1, dtype=torch.int32)
                args[1] = torch.zeros(S, 40000, dtype=torch.int16)
                expect = "hot size H"
        if expect is None:
            o_keys, o_lru = [list(r) for r in slot_keys], [list(r) for r in lru]
            oracle.invalidate(o_keys, o_lru, rows, keys)
            ops.invalidate(*args)
            assert args[0].tolist() == o_keys and args[1].tolist() == o_lru, where
            valid += 1
            continue
        _expect_named_error(
            "hisparse_invalidate", lambda: ops.invalidate(*args), args, expect, where
        )
        errors += 1
    assert errors > CALLS_PER_SEED // 4 and valid > CALLS_PER_SEED // 4
