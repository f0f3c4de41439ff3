"""Answer extraction and comparison for GSM8K.

Reference answers end with ``#### <number>``. Model completions are read in this order of
preference: the first ``#### <number>`` (the format the few-shot examples teach), then the last
"the answer is <number>", then the last number in the text. Numbers may carry thousands
separators, a leading sign, a currency sign, a decimal part or a trailing unit/period;
comparison is numeric ("18.00" == "18", "1,234" == "1234").
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

# A number: optional sign, optional $, digits with optional comma groups, optional decimals;
# or a bare decimal like ".5". The comma groups must be exactly three digits.
_NUM = r"[-+−]?\$?\s?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|[-+−]?\$?\.\d+"
_NUM_RE = re.compile(_NUM)
_HASH_RE = re.compile(r"####\s*(" + _NUM + r")")
_ANSWER_IS_RE = re.compile(
    r"answer\s*(?:is|=|:)\s*(?:\*\*)?\s*(?:approximately\s+|about\s+)?(" + _NUM + r")",
    re.IGNORECASE,
)


def normalize_number(text: str) -> Optional[str]:
    """Canonical string of a number as written ("$1,234.50" -> "1234.5", "-3.0" -> "-3"),
    or None if `text` is not a number."""
    t = text.strip().replace("−", "-").replace("$", "").replace(",", "").replace(" ", "")
    t = t.rstrip(".")
    if not t:
        return None
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_reference(answer: str) -> str:
    """The number after '####' in a GSM8K reference solution."""
    m = _HASH_RE.search(answer)
    if not m:
        raise ValueError(f"reference answer has no '#### <number>': {answer[-80:]!r}")
    value = normalize_number(m.group(1))
    if value is None:
        raise ValueError(f"reference answer is not a number: {m.group(1)!r}")
    return value


def extract_answer(completion: str) -> Optional[str]:
    """The model's final numeric answer in canonical form, or None (an invalid answer)."""
    if not completion:
        return None
    m = _HASH_RE.search(completion)
    if m:
        return normalize_number(m.group(1))
    hits = _ANSWER_IS_RE.findall(completion)
    if hits:
        return normalize_number(hits[-1])
    nums = _NUM_RE.findall(completion)
    for cand in reversed(nums):
        v = normalize_number(cand)
        if v is not None:
            return v
    return None


def is_correct(predicted: Optional[str], reference: str) -> bool:
    if predicted is None:
        return False
    return Decimal(predicted) == Decimal(reference)
