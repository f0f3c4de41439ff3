"""Every argument of every op is validated before any work, with an error naming it."""

from __future__ import annotations

import pytest
import torch

from hisparse import ops
from tests.helpers import new_plan, new_state

B, K, S, H = 2, 4, 3, 8


def resolve_args():
    slot_keys, lru, stats = new_state(S, H)
    out, src, dst, count = new_plan(B, K)
    return dict(
        top_k=torch.zeros(B, K, dtype=torch.int32),
        state_rows=torch.tensor([0, 1], dtype=torch.int32),
        slot_keys=slot_keys,
        lru=lru,
        stats=stats,
        out_rows=out,
        miss_src=src,
        miss_dst=dst,
        miss_count=count,
        num_keys=100,
        hot_base=0,
        resident_rows=None,
    )


def call_resolve(a):
    ops.resolve_residency(
        a["top_k"],
        a["state_rows"],
        a["slot_keys"],
        a["lru"],
        a["stats"],
        a["out_rows"],
        a["miss_src"],
        a["miss_dst"],
        a["miss_count"],
        num_keys=a["num_keys"],
        hot_base=a["hot_base"],
        resident_rows=a["resident_rows"],
    )


def _wrong_dtype(t):
    return t.to(torch.int64) if t.dtype != torch.int64 else t.to(torch.int32)


# (argument, how to break it, expected fragment of the message)
RESOLVE_CASES = [
    ("top_k", _wrong_dtype, "must be torch.int32"),
    ("top_k", lambda t: t.reshape(-1), "must be 2-D"),
    ("top_k", lambda t: torch.zeros(K, B, dtype=torch.int32).t(), "must be contiguous"),
    ("top_k", lambda t: torch.zeros(B, 0, dtype=torch.int32), "at least one column"),
    ("top_k", lambda t: torch.zeros(B, H + 1, dtype=torch.int32), "K <= H"),
    ("state_rows", _wrong_dtype, "must be torch.int32"),
    ("state_rows", lambda t: t[:1].clone(), "must have shape"),
    ("state_rows", lambda t: t.reshape(1, 2), "must be 1-D"),
    ("resident_rows", lambda t: torch.zeros(B, K, dtype=torch.int64), "must be torch.int32"),
    ("resident_rows", lambda t: torch.zeros(B, K + 1, dtype=torch.int32), "must have shape"),
    ("slot_keys", _wrong_dtype, "must be torch.int32"),
    ("slot_keys", lambda t: t.reshape(-1), "must be 2-D"),
    ("slot_keys", lambda t: torch.full((S, 40000), -1, dtype=torch.int32), "K <= H"),
    ("lru", lambda t: t.to(torch.int32), "must be torch.int16"),
    ("lru", lambda t: t[:, :4].clone(), "must have shape"),
    ("lru", lambda t: torch.zeros(H, S, dtype=torch.int16).t(), "must be contiguous"),
    ("stats", lambda t: t.to(torch.int64), "must be torch.uint64"),
    ("stats", lambda t: torch.zeros(3, dtype=torch.uint64), "must have shape"),
    ("stats", lambda t: torch.zeros(1, 2, dtype=torch.uint64), "must be 1-D"),
    ("out_rows", _wrong_dtype, "must be torch.int32"),
    ("out_rows", lambda t: t[:1].clone(), "must have shape"),
    ("miss_src", _wrong_dtype, "must be torch.int32"),
    ("miss_src", lambda t: t[:, :2].clone(), "must have shape"),
    ("miss_dst", _wrong_dtype, "must be torch.int32"),
    ("miss_dst", lambda t: t[:1].clone(), "must have shape"),
    ("miss_count", _wrong_dtype, "must be torch.int32"),
    ("miss_count", lambda t: t[:1].clone(), "must have shape"),
    ("num_keys", lambda v: -1, "num_keys"),
    ("num_keys", lambda v: 2**31, "num_keys"),
    ("hot_base", lambda v: -1, "hot_base"),
    ("hot_base", lambda v: 2**31 - 10, "hot_base"),
    ("hot_base", lambda v: 2**63 - 1, "hot_base"),  # must not overflow the range check
]


@pytest.mark.parametrize(
    "name,breaker,fragment", RESOLVE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(RESOLVE_CASES)]
)
def test_resolve_rejects_bad_argument(name, breaker, fragment):
    a = resolve_args()
    if name == "resident_rows":
        a[name] = breaker(None)
    else:
        a[name] = breaker(a[name])
    before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError) as e:
        call_resolve(a)
    msg = str(e.value)
    assert "hisparse_resolve_residency" in msg and fragment in msg
    arg_names = {"num_keys", "hot_base"}
    if name not in arg_names and fragment != "K <= H":
        assert f"'{name}'" in msg
    # nothing was touched
    for k, v in before.items():
        assert torch.equal(a[k], v), k


def test_resolve_rejects_none_tensor():
    a = resolve_args()
    a["lru"] = None
    with pytest.raises((TypeError, RuntimeError)):  # torch's dispatcher refuses None
        call_resolve(a)


def gather_args():
    return dict(
        host=[torch.zeros(4, 2, 32, dtype=torch.uint8)],
        hot=[torch.zeros(8, 32, dtype=torch.uint8)],
        miss_src=torch.zeros(B, K, dtype=torch.int32),
        miss_dst=torch.zeros(B, K, dtype=torch.int32),
        miss_count=torch.ones(B, dtype=torch.int32),
        moved_bytes=torch.zeros(1, dtype=torch.uint64),
    )


def call_gather(a):
    ops.gather(a["host"], a["hot"], a["miss_src"], a["miss_dst"], a["miss_count"], a["moved_bytes"])


def _misaligned_rows():
    return torch.zeros(8 * 32 + 1, dtype=torch.uint8)[1:].reshape(8, 32)


GATHER_CASES = [
    ("host", lambda a: [], "at least one view"),
    ("host", lambda a: a["host"] * 2, "same length"),
    ("host[0]", lambda a: [a["host"][0].to(torch.int16)], "must be torch.uint8"),
    ("host[0]", lambda a: [a["host"][0].reshape(-1)], "2-D [rows, row_bytes] or 3-D"),
    ("host[0]", lambda a: [torch.zeros(4, 24, dtype=torch.uint8)], "multiple of 16"),
    ("host[0]", lambda a: [torch.zeros(4, 2, 64, dtype=torch.uint8)[:, :, ::2]], "last stride 1"),
    ("host[0]", lambda a: [torch.zeros(4, 40, dtype=torch.uint8)[:, :32]], "multiples of 16"),
    ("host[0]", lambda a: [_misaligned_rows()], "16-byte aligned"),
    ("hot[0]", lambda a: [torch.zeros(8, 48, dtype=torch.uint8)], "same row size"),
    ("hot[0]", lambda a: [torch.zeros(8, 32, dtype=torch.float32)], "must be torch.uint8"),
    ("miss_src", lambda a: a["miss_src"].long(), "must be torch.int32"),
    ("miss_src", lambda a: a["miss_src"].reshape(-1), "must be 2-D"),
    ("miss_dst", lambda a: a["miss_dst"][:, :1].clone(), "must have shape"),
    ("miss_dst", lambda a: a["miss_dst"].long(), "must be torch.int32"),
    ("miss_count", lambda a: a["miss_count"][:1].clone(), "must have shape"),
    ("miss_count", lambda a: a["miss_count"].long(), "must be torch.int32"),
    ("moved_bytes", lambda a: torch.zeros(2, dtype=torch.uint64), "must have shape"),
    ("moved_bytes", lambda a: torch.zeros(1, dtype=torch.int64), "must be torch.uint64"),
]


@pytest.mark.parametrize(
    "name,breaker,fragment", GATHER_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(GATHER_CASES)]
)
def test_gather_rejects_bad_argument(name, breaker, fragment):
    a = gather_args()
    key = name.split("[")[0]
    a[key] = breaker(a)
    hot_before = [h.clone() for h in a["hot"]]
    with pytest.raises(RuntimeError) as e:
        call_gather(a)
    msg = str(e.value)
    assert "hisparse_gather" in msg and fragment in msg
    if fragment not in ("at least one view", "same length"):
        assert f"'{name}'" in msg
    for h, b in zip(a["hot"], hot_before):
        assert torch.equal(h, b)


def invalidate_args():
    slot_keys, lru, _ = new_state(S, H)
    return dict(
        slot_keys=slot_keys,
        lru=lru,
        state_rows=torch.tensor([0, 1], dtype=torch.int32),
        keys=torch.tensor([3, 4], dtype=torch.int32),
    )


INVALIDATE_CASES = [
    ("slot_keys", lambda t: t.long(), "must be torch.int32"),
    ("slot_keys", lambda t: t.reshape(-1), "must be 2-D"),
    ("slot_keys", lambda t: torch.full((S, 40000), -1, dtype=torch.int32), "hot size"),
    ("lru", lambda t: t.int(), "must be torch.int16"),
    ("lru", lambda t: t[:1].clone(), "must have shape"),
    ("state_rows", lambda t: t.long(), "must be torch.int32"),
    ("state_rows", lambda t: t.reshape(1, 2), "must be 1-D"),
    ("keys", lambda t: t.long(), "must be torch.int32"),
    ("keys", lambda t: t[:1].clone(), "must have shape"),
]


@pytest.mark.parametrize(
    "name,breaker,fragment",
    INVALIDATE_CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(INVALIDATE_CASES)],
)
def test_invalidate_rejects_bad_argument(name, breaker, fragment):
    a = invalidate_args()
    a[name] = breaker(a[name])
    before = a["slot_keys"].clone()
    with pytest.raises(RuntimeError) as e:
        ops.invalidate(a["slot_keys"], a["lru"], a["state_rows"], a["keys"])
    msg = str(e.value)
    assert "hisparse_invalidate" in msg and fragment in msg
    if fragment != "hot size":
        assert f"'{name}'" in msg
    assert torch.equal(a["slot_keys"], before)


def test_out_of_range_inputs_are_memory_safe_and_documented():
    """Out-of-range keys act as padding; bad state rows are padding rows; bad plan rows skip."""
    from tests.helpers import run_resolve, stats_list

    slot_keys, lru, stats = new_state(2, 4)
    top_k = torch.tensor([[-5, 99, 2**31 - 1, 3], [1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    rows = torch.tensor([0, 7, -3], dtype=torch.int32)
    out, src, dst, count = run_resolve(top_k, rows, slot_keys, lru, stats, num_keys=10)
    assert out.tolist() == [[-1, -1, -1, 0], [-1] * 4, [-1] * 4]
    assert count.tolist() == [1, 0, 0]
    assert stats_list(stats) == [0, 1]
    # a corrupted LRU (slot ids outside [0, H)) never indexes out of bounds
    lru[0] = torch.tensor([30000, -5, 2, 3], dtype=torch.int16)
    out, _, _, count = run_resolve(
        torch.tensor([[5, 6, 7, 8]], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        slot_keys,
        lru,
        stats,
        num_keys=10,
    )
    assert count.tolist() == [2]  # only two valid evictable slots
    host = [torch.arange(64, dtype=torch.uint8).reshape(2, 32)]
    hot = [torch.zeros(2, 32, dtype=torch.uint8)]
    src = torch.tensor([[1, 5, -1, 0]], dtype=torch.int32)
    dst = torch.tensor([[0, 0, 1, 9]], dtype=torch.int32)
    moved = torch.zeros(1, dtype=torch.uint64)
    ops.gather(host, hot, src, dst, torch.tensor([100], dtype=torch.int32), moved)
    assert torch.equal(hot[0][0], host[0][1]) and int(hot[0][1].sum()) == 0
    assert int(moved[0]) == 32
