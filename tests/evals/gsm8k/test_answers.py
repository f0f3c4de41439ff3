"""evals/gsm8k/answers.py: answer extraction, references and the comparison."""

from __future__ import annotations

import pytest

from evals.gsm8k.answers import extract_answer, extract_reference, is_correct, normalize_number


@pytest.mark.parametrize(
    "text,expected",
    [
        ("#### 42", "42"),
        ("She pays 5 + 3 = 8 dollars.\n#### 8", "8"),
        ("The answer is 1,234.", "1234"),
        ("The answer is $1,234.50.", "1234.5"),
        ("#### -7", "-7"),
        ("####-7", "-7"),
        ("The temperature drops to -15 degrees.", "-15"),
        ("The answer is −3.", "-3"),
        ("The answer is 3.75", "3.75"),
        ("It costs 18.00 dollars.", "18"),
        ("answer: .5", "0.5"),
        ("#### 12\n\nQuestion: Tom has 99 apples", "12"),
        ("So the answer is 12. Then she buys 3 more for next week.", "12"),
        ("He has 5 apples, then 7 more, so 12 in total.", "12"),
        ("There are 2,000,000 people.", "2000000"),
        ("#### 1,000.", "1000"),
        ("The answer is **36**.", "36"),
        ("No number here.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_hash_answer_wins_over_later_numbers_and_answer_is_over_last_number():
    assert extract_answer("#### 5\nextra 9 and 10") == "5"
    assert extract_answer("the answer is 4; check: 2 + 2 = 4, 7") == "4"


def test_reference_and_comparison():
    assert extract_reference("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert extract_reference("...\n#### 1,080") == "1080"
    with pytest.raises(ValueError, match="no '#### <number>'"):
        extract_reference("no final answer")
    assert is_correct("18", "18") and is_correct(normalize_number("18.00"), "18")
    assert not is_correct("17", "18") and not is_correct(None, "18")
    assert normalize_number("$1,234.50") == "1234.5" and normalize_number("abc") is None
