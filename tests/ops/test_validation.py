"""Every argument of every op is validated before any work, with an error naming it; each
breaker below runs on both backends (the `device` fixture), and the CUDA backend must give the
CPU backend's error, word for word."""

from __future__ import annotations

import pytest
import torch

from hisparse import ops
from tests.devices import host_side, needs_cuda
from tests.helpers import new_plan, new_state, run_resolve, stats_list

B, K, S, H = 2, 4, 3, 8
I32 = torch.int32


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.cpu(), b.cpu()
    if a.dtype == torch.uint64 or b.dtype == torch.uint64:  # few ops support uint64
        return a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    return torch.equal(a, b)


def _first_line(call) -> str:
    with pytest.raises(RuntimeError) as e:
        call()
    return str(e.value).splitlines()[0]


def _assert_cpu_says_the_same(msg: str, device: str, make_args, name, breaker, call):
    """On CUDA: the CPU backend, given the same breakage, fails with the same first line."""
    if device == "cpu":
        return
    a = make_args("cpu")
    a[name] = breaker(a, "cpu")
    assert msg.splitlines()[0].replace("cuda:0", "cpu") == _first_line(lambda: call(a))


# --------------------------------------------------------------------------------------------
# hisparse_resolve_residency
# --------------------------------------------------------------------------------------------


def resolve_args(device="cpu"):
    slot_keys, lru, stats = new_state(S, H, device)
    out, src, dst, count = new_plan(B, K, device)
    return dict(
        top_k=torch.zeros(B, K, dtype=I32, device=device),
        state_rows=torch.tensor([0, 1], dtype=I32, device=device),
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


# (argument, how to break it given the current value and the device, expected message fragment)
RESOLVE_CASES = [
    ("top_k", lambda t, d: _wrong_dtype(t), "must be torch.int32"),
    ("top_k", lambda t, d: t.reshape(-1), "must be 2-D"),
    ("top_k", lambda t, d: torch.zeros(K, B, dtype=I32, device=d).t(), "must be contiguous"),
    ("top_k", lambda t, d: torch.zeros(B, 0, dtype=I32, device=d), "at least one column"),
    ("top_k", lambda t, d: torch.zeros(B, H + 1, dtype=I32, device=d), "K <= H"),
    ("state_rows", lambda t, d: _wrong_dtype(t), "must be torch.int32"),
    ("state_rows", lambda t, d: t[:1].clone(), "must have shape"),
    ("state_rows", lambda t, d: t.reshape(1, 2), "must be 1-D"),
    (
        "resident_rows",
        lambda t, d: torch.zeros(B, K, dtype=torch.int64, device=d),
        "must be torch.int32",
    ),
    ("resident_rows", lambda t, d: torch.zeros(B, K + 1, dtype=I32, device=d), "must have shape"),
    ("slot_keys", lambda t, d: _wrong_dtype(t), "must be torch.int32"),
    ("slot_keys", lambda t, d: t.reshape(-1), "must be 2-D"),
    ("slot_keys", lambda t, d: torch.full((S, 40000), -1, dtype=I32, device=d), "K <= H"),
    ("lru", lambda t, d: t.to(torch.int32), "must be torch.int16"),
    ("lru", lambda t, d: t[:, :4].clone(), "must have shape"),
    ("lru", lambda t, d: torch.zeros(H, S, dtype=torch.int16, device=d).t(), "must be contiguous"),
    ("stats", lambda t, d: t.to(torch.int64), "must be torch.uint64"),
    ("stats", lambda t, d: torch.zeros(3, dtype=torch.uint64, device=d), "must have shape"),
    ("stats", lambda t, d: torch.zeros(1, 2, dtype=torch.uint64, device=d), "must be 1-D"),
    ("out_rows", lambda t, d: _wrong_dtype(t), "must be torch.int32"),
    ("out_rows", lambda t, d: t[:1].clone(), "must have shape"),
    ("miss_src", lambda t, d: _wrong_dtype(t), "must be torch.int32"),
    ("miss_src", lambda t, d: t[:, :2].clone(), "must have shape"),
    ("miss_dst", lambda t, d: _wrong_dtype(t), "must be torch.int32"),
    ("miss_dst", lambda t, d: t[:1].clone(), "must have shape"),
    ("miss_count", lambda t, d: _wrong_dtype(t), "must be torch.int32"),
    ("miss_count", lambda t, d: t[:1].clone(), "must have shape"),
    ("num_keys", lambda v, d: -1, "num_keys"),
    ("num_keys", lambda v, d: 2**31, "num_keys"),
    ("hot_base", lambda v, d: -1, "hot_base"),
    ("hot_base", lambda v, d: 2**31 - 10, "hot_base"),
    ("hot_base", lambda v, d: 2**63 - 1, "hot_base"),  # must not overflow the range check
    ("miss_dst", lambda t, d: t[:, :2].clone(), "must have shape"),
]


@pytest.mark.parametrize(
    "name,breaker,fragment", RESOLVE_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(RESOLVE_CASES)]
)
def test_resolve_rejects_bad_argument(device, name, breaker, fragment):
    a = resolve_args(device)
    a[name] = breaker(a[name], device)
    before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError) as e:
        call_resolve(a)
    msg = str(e.value)
    assert "hisparse_resolve_residency" in msg and fragment in msg
    assert msg.startswith("hisparse_resolve_residency")
    arg_names = {"num_keys", "hot_base"}
    if name not in arg_names and fragment != "K <= H":
        assert f"'{name}'" in msg
    # nothing was touched
    for k, v in before.items():
        assert _same(a[k], v), k
    _assert_cpu_says_the_same(
        msg, device, resolve_args, name, lambda a, d: breaker(a[name], d), call_resolve
    )


def test_resolve_rejects_none_tensor():
    a = resolve_args()
    a["lru"] = None
    with pytest.raises((TypeError, RuntimeError)):  # torch's dispatcher refuses None
        call_resolve(a)


@pytest.mark.cuda
@needs_cuda
def test_resolve_rejects_mixed_devices():
    a = resolve_args("cuda")
    a["lru"] = a["lru"].cpu()
    with pytest.raises(RuntimeError, match="argument 'lru' must be on cuda:0"):
        call_resolve(a)


# --------------------------------------------------------------------------------------------
# hisparse_gather
# --------------------------------------------------------------------------------------------


def gather_args(device="cpu"):
    return dict(
        host=[host_side(torch.zeros(4, 2, 32, dtype=torch.uint8), device)],
        hot=[torch.zeros(8, 32, dtype=torch.uint8, device=device)],
        miss_src=torch.zeros(B, K, dtype=I32, device=device),
        miss_dst=torch.zeros(B, K, dtype=I32, device=device),
        miss_count=torch.ones(B, dtype=I32, device=device),
        moved_bytes=torch.zeros(1, dtype=torch.uint64, device=device),
    )


def call_gather(a):
    ops.gather(a["host"], a["hot"], a["miss_src"], a["miss_dst"], a["miss_count"], a["moved_bytes"])


def _host_u8(d, *shape):
    return host_side(torch.zeros(*shape, dtype=torch.uint8), d)


GATHER_CASES = [
    ("host", lambda a, d: [], "at least one view"),
    ("host", lambda a, d: a["host"] * 2, "same length"),
    ("host[0]", lambda a, d: [a["host"][0].to(torch.int16)], "must be torch.uint8"),
    ("host[0]", lambda a, d: [a["host"][0].reshape(-1)], "2-D [rows, row_bytes] or 3-D"),
    ("host[0]", lambda a, d: [_host_u8(d, 4, 24)], "multiple of 16"),
    ("host[0]", lambda a, d: [_host_u8(d, 4, 2, 64)[:, :, ::2]], "last stride 1"),
    ("host[0]", lambda a, d: [_host_u8(d, 4, 40)[:, :32]], "multiples of 16"),
    ("host[0]", lambda a, d: [_host_u8(d, 8 * 32 + 1)[1:].reshape(8, 32)], "16-byte aligned"),
    ("hot[0]", lambda a, d: [torch.zeros(8, 48, dtype=torch.uint8, device=d)], "same row size"),
    (
        "hot[0]",
        lambda a, d: [torch.zeros(8, 32, dtype=torch.float32, device=d)],
        "must be torch.uint8",
    ),
    ("miss_src", lambda a, d: a["miss_src"].long(), "must be torch.int32"),
    ("miss_src", lambda a, d: a["miss_src"].reshape(-1), "must be 2-D"),
    ("miss_dst", lambda a, d: a["miss_dst"][:, :1].clone(), "must have shape"),
    ("miss_dst", lambda a, d: a["miss_dst"].long(), "must be torch.int32"),
    ("miss_count", lambda a, d: a["miss_count"][:1].clone(), "must have shape"),
    ("miss_count", lambda a, d: a["miss_count"].long(), "must be torch.int32"),
    (
        "moved_bytes",
        lambda a, d: torch.zeros(2, dtype=torch.uint64, device=d),
        "must have shape",
    ),
    (
        "moved_bytes",
        lambda a, d: torch.zeros(1, dtype=torch.int64, device=d),
        "must be torch.uint64",
    ),
]


@pytest.mark.parametrize(
    "name,breaker,fragment", GATHER_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(GATHER_CASES)]
)
def test_gather_rejects_bad_argument(device, name, breaker, fragment):
    a = gather_args(device)
    key = name.split("[")[0]
    a[key] = breaker(a, device)
    hot_before = [h.clone() for h in a["hot"]]
    with pytest.raises(RuntimeError) as e:
        call_gather(a)
    msg = str(e.value)
    assert "hisparse_gather" in msg and fragment in msg
    assert msg.startswith("hisparse_gather")
    if fragment not in ("at least one view", "same length"):
        assert f"'{name}'" in msg
    for h, b in zip(a["hot"], hot_before):
        assert _same(h, b)
    _assert_cpu_says_the_same(msg, device, gather_args, key, breaker, call_gather)


@pytest.mark.cuda
@needs_cuda
def test_gather_rejects_unpinned_host_memory():
    a = gather_args("cuda")
    a["host"] = [torch.zeros(4, 2, 32, dtype=torch.uint8)]
    assert not a["host"][0].is_pinned()
    with pytest.raises(
        RuntimeError,
        match=r"hisparse_gather: argument 'host\[0\]' must be in "
        r"pinned host memory or on cuda:0",
    ):
        call_gather(a)
    a = gather_args("cuda")
    a["hot"] = [a["hot"][0].cpu()]
    with pytest.raises(RuntimeError, match=r"argument 'hot\[0\]' must be on cuda:0"):
        call_gather(a)


# --------------------------------------------------------------------------------------------
# hisparse_invalidate
# --------------------------------------------------------------------------------------------


def invalidate_args(device="cpu"):
    slot_keys, lru, _ = new_state(S, H, device)
    return dict(
        slot_keys=slot_keys,
        lru=lru,
        state_rows=torch.tensor([0, 1], dtype=I32, device=device),
        keys=torch.tensor([3, 4], dtype=I32, device=device),
    )


def call_invalidate(a):
    ops.invalidate(a["slot_keys"], a["lru"], a["state_rows"], a["keys"])


INVALIDATE_CASES = [
    ("slot_keys", lambda t, d: t.long(), "must be torch.int32"),
    ("slot_keys", lambda t, d: t.reshape(-1), "must be 2-D"),
    ("slot_keys", lambda t, d: torch.full((S, 40000), -1, dtype=I32, device=d), "hot size"),
    ("lru", lambda t, d: t.int(), "must be torch.int16"),
    ("lru", lambda t, d: t[:1].clone(), "must have shape"),
    ("state_rows", lambda t, d: t.long(), "must be torch.int32"),
    ("state_rows", lambda t, d: t.reshape(1, 2), "must be 1-D"),
    ("keys", lambda t, d: t.long(), "must be torch.int32"),
    ("keys", lambda t, d: t[:1].clone(), "must have shape"),
]


@pytest.mark.parametrize(
    "name,breaker,fragment",
    INVALIDATE_CASES,
    ids=[f"{c[0]}-{i}" for i, c in enumerate(INVALIDATE_CASES)],
)
def test_invalidate_rejects_bad_argument(device, name, breaker, fragment):
    a = invalidate_args(device)
    a[name] = breaker(a[name], device)
    before = a["slot_keys"].clone()
    with pytest.raises(RuntimeError) as e:
        call_invalidate(a)
    msg = str(e.value)
    assert "hisparse_invalidate" in msg and fragment in msg
    assert msg.startswith("hisparse_invalidate")
    if fragment != "hot size":
        assert f"'{name}'" in msg
    assert _same(a["slot_keys"], before)
    _assert_cpu_says_the_same(
        msg, device, invalidate_args, name, lambda a, d: breaker(a[name], d), call_invalidate
    )


# --------------------------------------------------------------------------------------------
# out-of-range values are not errors: they are memory safe and documented
# --------------------------------------------------------------------------------------------


def test_out_of_range_inputs_are_memory_safe_and_documented(device):
    """Out-of-range keys act as padding; bad state rows are padding rows; bad plan rows skip."""
    d = device
    slot_keys, lru, stats = new_state(2, 4, d)
    top_k = torch.tensor([[-5, 99, 2**31 - 1, 3], [1, 2, 3, 4], [5, 6, 7, 8]], dtype=I32, device=d)
    rows = torch.tensor([0, 7, -3], dtype=I32, device=d)
    out, src, dst, count = run_resolve(top_k, rows, slot_keys, lru, stats, num_keys=10)
    assert out.tolist() == [[-1, -1, -1, 0], [-1] * 4, [-1] * 4]
    assert count.tolist() == [1, 0, 0]
    assert stats_list(stats) == [0, 1]
    # a corrupted LRU (slot ids outside [0, H)) never indexes out of bounds
    lru[0] = torch.tensor([30000, -5, 2, 3], dtype=torch.int16, device=d)
    out, _, _, count = run_resolve(
        torch.tensor([[5, 6, 7, 8]], dtype=I32, device=d),
        torch.tensor([0], dtype=I32, device=d),
        slot_keys,
        lru,
        stats,
        num_keys=10,
    )
    assert count.tolist() == [2]  # only two valid evictable slots
    hosts = [host_side(torch.arange(64, dtype=torch.uint8).reshape(2, 32), d)]
    hot = [torch.zeros(2, 32, dtype=torch.uint8, device=d)]
    src = torch.tensor([[1, 5, -1, 0]], dtype=I32, device=d)
    dst = torch.tensor([[0, 0, 1, 9]], dtype=I32, device=d)
    moved = torch.zeros(1, dtype=torch.uint64, device=d)
    ops.gather(hosts, hot, src, dst, torch.tensor([100], dtype=I32, device=d), moved)
    hot0 = hot[0].cpu()
    assert torch.equal(hot0[0], hosts[0][1]) and int(hot0[1].sum()) == 0
    assert moved.cpu().tolist() == [32]
