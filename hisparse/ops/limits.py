"""The ops' limits and the one integer validator every settings class uses.

The numbers are csrc/hisparse_limits.h's; the built extension exports its own copy, and
``check_extension`` (run when ``hisparse.ops.extension`` loads it) refuses a build whose
numbers differ,
so Python and the kernels cannot disagree. They are written out here rather than read from the
extension because this module must import without it, and without torch: the CLI builds its
parser from them and must not pay seconds of torch import for ``--help``.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Type

#: Largest hot buffer per state row: slot ids and LRU entries are int16.
MAX_HOT_SIZE = 2**15


def default_hot_size(top_k: int) -> int:
    """Hot-buffer rows per request when none are given: twice the top-k, within the limit."""
    return min(2 * top_k, MAX_HOT_SIZE)


#: Keys, hot rows and plan entries are int32.
INT32_MAX = 2**31 - 1

#: The kernels read the ops' integer arguments as int64; each one's own range is narrower.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

#: Rows move as 16-byte vector words: row sizes, strides and data pointers are multiples of it.
ROW_ALIGN = 16

#: The names ``hisparse._C`` exports, with the values this module expects.
EXPECTED = {"MAX_HOT_SIZE": MAX_HOT_SIZE, "INT32_MAX": INT32_MAX, "ROW_ALIGN": ROW_ALIGN}


def reported_by(ext) -> dict:
    """The limits a loaded extension module was built with (None for a name it lacks)."""
    return {name: getattr(ext, name, None) for name in EXPECTED}


def check_extension(ext) -> None:
    """Raise ImportError when ``ext`` was built with other limits than these (a stale build)."""
    got = reported_by(ext)
    bad = [f"{k}={got[k]} (expected {v})" for k, v in EXPECTED.items() if got[k] != v]
    if bad:
        raise ImportError(
            "hisparse._C was built with other limits than hisparse/ops/limits.py: "
            f"{', '.join(bad)}; "
            "rebuild it with `pip install --no-build-isolation -e .`"
        )


def check_int(
    name: str,
    value: Any,
    minimum: int,
    maximum: Optional[int] = None,
    *,
    error: Type[Exception] = ValueError,
) -> int:
    """``value`` if it is an int (not a bool) in [minimum, maximum]; otherwise ``error`` with a
    one-line message that starts with ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise error(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise error(f"{name} must be <= {maximum}, got {value}")
    return value


def as_index(
    name: str,
    value: Any,
    minimum: Optional[int] = None,
    maximum: Optional[int] = None,
    *,
    error: Type[Exception] = ValueError,
) -> int:
    """The one rule for integers handed in at run time (keys, rows, token counts, op sizes):
    whatever ``operator.index`` takes (int, numpy and torch integer scalars, found without
    importing either) as a plain int in [minimum, maximum]; a bool of any kind, a float, a
    fractional tensor or an array is ``error`` with one line starting with ``name``."""
    dtype = str(getattr(value, "dtype", ""))
    if isinstance(value, bool) or dtype.endswith("bool") or getattr(value, "ndim", 0) != 0:
        raise error(f"{name} must be an integer, got {_describe(value)}")
    try:
        v = operator.index(value)
    except TypeError:
        raise error(f"{name} must be an integer, got {_describe(value)}") from None
    if minimum is not None and v < minimum:
        raise error(f"{name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise error(f"{name} must be <= {maximum}, got {v}")
    return v


def _describe(value: Any) -> str:
    dtype = getattr(value, "dtype", None)
    kind = f"{type(value).__name__} of {dtype}" if dtype is not None else type(value).__name__
    return f"{kind} {value!r}".replace("\n", " ")
