"""resolve_residency's integer arguments (num_keys, hot_base): a bool or a float is refused by
name, through the Python wrapper, through ``torch.ops`` directly (the schema takes Scalars so
the kernels see the type; torch's ``int`` would pass True on as 1) and on meta tensors; numpy
and torch integer scalars are taken as the integers they are; an integer no int64 holds is refused
by name too. Both backends (`device`)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import RESOLVE_TENSOR_ARGS
from tests.ops.test_validation import call_resolve, resolve_args

OP = "hisparse_resolve_residency"


def _direct(a):
    """The op through torch.ops, arguments in schema order."""
    args = [a[n] for n in RESOLVE_TENSOR_ARGS] + [a["num_keys"], a["hot_base"]]
    torch.ops.hisparse.hisparse_resolve_residency(*args)


@pytest.mark.parametrize("name", ["num_keys", "hot_base"])
@pytest.mark.parametrize("value", [True, False, 1.0, 2.5])
@pytest.mark.parametrize("call", [call_resolve, _direct], ids=["wrapper", "torch.ops"])
def test_bool_or_float_size_arguments_are_refused_by_name(device, name, value, call):
    a = resolve_args(device)
    a[name] = value
    before = a["slot_keys"].clone()
    with pytest.raises(RuntimeError, match=rf"^{OP}: argument '{name}' must be an int") as e:
        call(a)
    assert "\n" not in str(e.value).strip()
    assert torch.equal(a["slot_keys"], before)  # refused before any work


def test_the_wrapper_takes_integer_scalars(device):
    """numpy and 0-d torch integers become plain ints in the wrapper (torch.ops itself, like any
    op with a Scalar argument, takes Python numbers only)."""
    a = resolve_args(device)
    a["top_k"][:] = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    a["num_keys"], a["hot_base"] = torch.tensor(100), torch.tensor(0)
    call_resolve(a)
    assert a["miss_count"].tolist() == [4, 4]
    np = pytest.importorskip("numpy")
    a["num_keys"], a["hot_base"] = np.int64(100), np.int32(0)
    call_resolve(a)
    assert a["miss_count"].tolist() == [0, 0]  # all hits the second time


def test_torch_ops_takes_plain_ints(device):
    a = resolve_args(device)
    a["top_k"][:] = 1
    _direct(a)
    assert a["miss_count"].tolist() == [1, 1]


@pytest.mark.parametrize("name", ["num_keys", "hot_base"])
def test_meta_tensors_refuse_a_bool_as_the_kernels_do(name):
    a = resolve_args("meta")
    a[name] = True
    with pytest.raises(RuntimeError, match=rf"{OP}: argument '{name}' must be an int"):
        _direct(a)


# Integers no int64 holds: torch would refuse them without naming the argument ("int too big to
# convert", "value cannot be converted to type int64_t without overflow").
BEYOND_INT64 = [2**63, 2**64 - 1, 2**64, 2**100, -(2**63) - 1, -(2**70)]
RANGE = r"must be in \[0, 2\^31-1\]"


@pytest.mark.parametrize("name", ["num_keys", "hot_base"])
@pytest.mark.parametrize("value", BEYOND_INT64, ids=[f"{v:#x}" for v in BEYOND_INT64])
def test_integers_beyond_int64_are_refused_by_name(device, name, value):
    a = resolve_args(device)
    a[name] = value
    before = a["slot_keys"].clone()
    want = rf"^{OP}: argument '{name}' {RANGE}, got {value}$"
    with pytest.raises(RuntimeError, match=want):
        call_resolve(a)
    assert torch.equal(a["slot_keys"], before)


def test_an_unsigned_numpy_scalar_beyond_int64_is_refused_by_name(device):
    np = pytest.importorskip("numpy")
    a = resolve_args(device)
    a["num_keys"] = np.uint64(2**64 - 1)
    with pytest.raises(RuntimeError, match=rf"^{OP}: argument 'num_keys' {RANGE}"):
        call_resolve(a)


@pytest.mark.parametrize("name", ["num_keys", "hot_base"])
@pytest.mark.parametrize("value", [2**63, 2**64 - 1])
def test_torch_ops_refuses_an_unsigned_int64_by_name(device, name, value):
    """torch.ops hands an int in [2^63, 2^64) to the op as an unsigned Scalar: the kernels'
    validator names it (one wider torch refuses itself, before the op is called)."""
    a = resolve_args(device)
    a[name] = value
    with pytest.raises(RuntimeError, match=rf"^{OP}: argument '{name}' {RANGE}"):
        _direct(a)


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1])
def test_meta_tensors_refuse_integers_beyond_int64_by_name(value):
    a = resolve_args("meta")
    a["hot_base"] = value
    with pytest.raises(RuntimeError, match=rf"{OP}: argument 'hot_base' {RANGE}"):
        call_resolve(a)
