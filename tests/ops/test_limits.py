"""hisparse.ops.limits: its numbers are the built extension's, it imports without torch, one integer
validator, and the empty residency state every caller builds."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hisparse import ops
from hisparse.ops import extension as _ext
from hisparse.ops import limits
from hisparse.runtime import empty_residency, reset_residency
from tests.helpers import child_timeout


def test_python_numbers_equal_what_the_built_extension_reports():
    ext = _ext.load()
    if ext is None:
        pytest.skip("hisparse._C is not built")
    assert limits.reported_by(ext) == limits.EXPECTED
    assert limits.EXPECTED == {"MAX_HOT_SIZE": 32768, "INT32_MAX": 2**31 - 1, "ROW_ALIGN": 16}


def test_a_build_with_other_limits_is_refused_by_name():
    stale = SimpleNamespace(**dict(limits.EXPECTED, MAX_HOT_SIZE=65536))
    with pytest.raises(ImportError, match=r"MAX_HOT_SIZE=65536 \(expected 32768\).*rebuild"):
        limits.check_extension(stale)
    with pytest.raises(ImportError, match=r"ROW_ALIGN=None"):
        limits.check_extension(SimpleNamespace(MAX_HOT_SIZE=32768, INT32_MAX=2**31 - 1))


def test_limits_and_the_cli_import_without_torch():
    code = "import sys, hisparse.ops.limits, hisparse.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=child_timeout(6))


@pytest.mark.parametrize(
    "value, message",
    [
        (1.5, "n must be an integer, got float 1.5"),
        (True, "n must be an integer, got bool True"),
        (-1, "n must be >= 0, got -1"),
        (9, "n must be <= 8, got 9"),
    ],
)
def test_check_int_names_the_argument_in_one_line(value, message):
    with pytest.raises(ValueError) as e:
        limits.check_int("n", value, 0, 8)
    assert str(e.value) == message


def test_check_int_returns_the_value_and_raises_the_callers_error():
    assert limits.check_int("n", 8, 0, 8) == 8 and limits.check_int("n", 10**9, 0) == 10**9
    with pytest.raises(KeyError):
        limits.check_int("n", 0, 1, error=KeyError)


def test_empty_residency_is_what_invalidate_leaves():
    slot_keys, lru = empty_residency(3, 5)
    assert slot_keys.dtype == torch.int32 and lru.dtype == torch.int16
    assert slot_keys.tolist() == [[-1] * 5] * 3 and lru.tolist() == [list(range(5))] * 3

    def dirty():
        return (
            torch.arange(15, dtype=torch.int32).reshape(3, 5),
            torch.arange(4, -1, -1, dtype=torch.int16).repeat(3, 1),
        )

    reset = dirty()
    reset_residency(*reset)
    assert torch.equal(reset[0], slot_keys) and torch.equal(reset[1], lru)
    if _ext.load() is not None:
        invalidated = dirty()
        ops.invalidate(*invalidated, torch.arange(3, dtype=torch.int32))
        assert torch.equal(invalidated[0], slot_keys) and torch.equal(invalidated[1], lru)
