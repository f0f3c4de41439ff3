"""StateRowAllocator alone: which request holds which state row, the order rows are handed out
and handed out again, what running out says, and that a release never hands one row out twice."""

from __future__ import annotations

import random

import pytest

from hisparse.runtime.state_rows import StateRowAllocator


def test_fresh_rows_are_handed_out_lowest_first():
    a = StateRowAllocator(3)
    assert [a.allocate(r) for r in ("a", "b", "c")] == [0, 1, 2]
    assert [a.row_of(r) for r in ("a", "b", "c", "d")] == [0, 1, 2, None]
    assert a.in_use == 3 and a.num_state_rows == 3


def test_allocating_a_request_again_returns_its_row_and_takes_no_other():
    a = StateRowAllocator(2)
    assert a.allocate("a") == 0
    assert a.allocate("a") == 0 and a.in_use == 1
    assert a.allocate("b") == 1  # the second row was still free


def test_the_last_released_row_is_reissued_first_then_untouched_rows():
    a = StateRowAllocator(4)
    for r in ("a", "b", "c"):
        a.allocate(r)
    assert a.free("a") == 0 and a.free("c") == 2
    assert a.in_use == 1 and a.row_of("a") is None and a.row_of("c") is None
    # Released rows come back before the never-used row 3, the most recent release first.
    assert [a.allocate(r) for r in ("d", "e", "f")] == [2, 0, 3]
    assert {r: a.row_of(r) for r in "bdef"} == {"b": 1, "d": 2, "e": 0, "f": 3}


def test_running_out_names_the_request_and_the_rows_and_changes_nothing():
    a = StateRowAllocator(2)
    a.allocate("a")
    a.allocate("b")
    with pytest.raises(RuntimeError) as e:
        a.allocate("late")
    assert str(e.value) == "no free state row for request 'late': all 2 in use"
    assert a.in_use == 2 and a.row_of("late") is None
    a.free("b")
    assert a.allocate("late") == 1  # the failed request can have the next free row


def test_releasing_twice_or_an_unknown_request_returns_none_and_frees_nothing():
    a = StateRowAllocator(2)
    a.allocate("a")
    a.allocate("b")
    assert a.free("a") == 0
    assert a.free("a") is None  # already released: row 0 must not be listed free twice
    assert a.free("never-seen") is None
    assert a.in_use == 1
    assert a.allocate("c") == 0
    with pytest.raises(RuntimeError, match="all 2 in use"):
        a.allocate("d")  # a second copy of row 0 would have been handed out here
    assert a.row_of("b") == 1


def test_any_hashable_request_id_holds_a_row():
    a = StateRowAllocator(3)
    assert (a.allocate(7), a.allocate(("req", 1)), a.allocate("7")) == (0, 1, 2)
    assert a.row_of(7) == 0 and a.row_of("7") == 2 and a.free(("req", 1)) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_the_number_of_rows_must_be_an_integer_of_at_least_one(bad):
    with pytest.raises(ValueError, match="^num_state_rows"):
        StateRowAllocator(bad)


def test_random_churn_keeps_live_rows_distinct_and_in_range():
    S = 5
    a = StateRowAllocator(S)
    rng = random.Random(7)
    live: dict = {}
    for i in range(400):
        if live and (len(live) == S or rng.random() < 0.45):
            rid = rng.choice(sorted(live))
            assert a.free(rid) == live.pop(rid)
        else:
            live[f"r{i}"] = a.allocate(f"r{i}")
        rows = sorted(live.values())
        assert len(set(rows)) == len(rows) and all(0 <= r < S for r in rows)
        assert a.in_use == len(live)
        assert all(a.row_of(rid) == row for rid, row in live.items())
