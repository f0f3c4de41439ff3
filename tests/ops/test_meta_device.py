"""A meta tensor among CPU tensors sends an op to its fake kernel (the dispatcher prefers Meta);
that must be a named device error, eagerly and under tracing, never a silent no-op."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from hisparse.ops import calls  # noqa: F401  (registers the fakes)
from tests.helpers import RESOLVE_TENSOR_ARGS, new_plan, new_state

RESOLVE = torch.ops.hisparse.hisparse_resolve_residency
GATHER = torch.ops.hisparse.hisparse_gather
INVALIDATE = torch.ops.hisparse.hisparse_invalidate


def _resolve_args():
    slot_keys, lru, stats = new_state(2, 8)
    out, src, dst, count = new_plan(2, 4)
    top_k = torch.tensor([[1, 2, 3, 3], [4, 5, -1, 6]], dtype=torch.int32)
    rows = torch.tensor([0, 1], dtype=torch.int32)
    resident = torch.full((2, 4), -1, dtype=torch.int32)
    return [top_k, rows, resident, slot_keys, lru, stats, out, src, dst, count, 100, 0]


def _gather_args():
    host = [torch.randint(0, 255, (16, 32), dtype=torch.uint8) for _ in range(2)]
    hot = [torch.zeros(16, 32, dtype=torch.uint8) for _ in range(2)]
    src = torch.tensor([[1, 2]], dtype=torch.int32)
    dst = torch.tensor([[3, 4]], dtype=torch.int32)
    count = torch.tensor([2], dtype=torch.int32)
    return [host, hot, src, dst, count, torch.zeros(1, dtype=torch.uint64)]


def _invalidate_args():
    slot_keys, lru, _ = new_state(2, 8)
    slot_keys[1, 3] = 5
    return [
        slot_keys,
        lru,
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32),
    ]


def _cases():
    # (op, args builder, index of the argument to make meta, element index or None, name)
    for i, name in enumerate(RESOLVE_TENSOR_ARGS):
        yield RESOLVE, _resolve_args, i, None, name
    for i, name in enumerate(["host", "hot"]):
        for j in range(2):
            yield GATHER, _gather_args, i, j, f"{name}[{j}]"
    for i, name in enumerate(["miss_src", "miss_dst", "miss_count", "moved_bytes"], start=2):
        yield GATHER, _gather_args, i, None, name
    for i, name in enumerate(["slot_keys", "lru", "state_rows", "keys"]):
        yield INVALIDATE, _invalidate_args, i, None, name


CASES = list(_cases())


def _with_meta(build, i, j):
    args = build()
    snapshot = [
        [t.clone() for t in a]
        if isinstance(a, list)
        else (a.clone() if isinstance(a, torch.Tensor) else a)
        for a in args
    ]
    if j is None:
        args[i] = args[i].to("meta")
    else:
        args[i] = list(args[i])
        args[i][j] = args[i][j].to("meta")
    return args, snapshot


def _flat(args):
    for a in args:
        yield from (a if isinstance(a, list) else [a])


@pytest.mark.parametrize(
    "op, build, i, j, name", CASES, ids=[f"{c[0].__name__}-{c[4]}" for c in CASES]
)
def test_one_meta_argument_is_a_named_error(op, build, i, j, name):
    args, before = _with_meta(build, i, j)
    with pytest.raises(RuntimeError, match=r"argument '[a-z_\[\]0-9]+' must be on ") as err:
        op(*args)
    msg = str(err.value)
    assert msg.startswith(op.__name__.split(".")[-1]) and "\n" not in msg.strip()
    # When the reference argument itself is meta, the error names the first real one instead.
    ref_is_meta = i == 0 and op is not GATHER or (op is GATHER and i == 2)
    if not ref_is_meta:
        assert f"'{name}'" in msg and "got meta" in msg
    # Nothing was written behind the caller's back.
    for got, want in zip(_flat(args), _flat(before)):
        if isinstance(got, torch.Tensor) and got.device.type != "meta":
            assert torch.equal(got, want)


@pytest.mark.parametrize(
    "op, build, i, j, name",
    CASES[:3] + CASES[10:11] + CASES[-2:],
    ids=lambda c: getattr(c, "__name__", str(c)),
)
def test_meta_argument_is_refused_under_fake_tensor_tracing(op, build, i, j, name):
    args, _ = _with_meta(build, i, j)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [
            [mode.from_tensor(t) for t in a]
            if isinstance(a, list)
            else (mode.from_tensor(a) if isinstance(a, torch.Tensor) else a)
            for a in args
        ]
        with pytest.raises(RuntimeError, match=r"must be on "):
            op(*fake)


def test_meta_argument_is_refused_under_make_fx():
    args, _ = _with_meta(_resolve_args, RESOLVE_TENSOR_ARGS.index("lru"), None)

    def step(*tensors):
        RESOLVE(*tensors, 100, 0)
        return tensors[6]

    with pytest.raises(RuntimeError, match=r"'lru' must be on cpu like 'top_k', got meta"):
        make_fx(step, tracing_mode="fake")(*args[:10])


def test_all_meta_and_all_fake_calls_still_trace():
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in _resolve_args()]
    RESOLVE(*args)
    g = _gather_args()
    # Host views may stay in (pinned) host memory while the rest is traced on another device.
    GATHER(g[0], [t.to("meta") for t in g[1]], *[t.to("meta") for t in g[2:]])
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in _resolve_args()]
        RESOLVE(*fake)
