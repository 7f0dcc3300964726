"""The host tier's free slots as runs (core/host_slot_runs.py): a step's saves get as few runs of
consecutive slots as possible (each run is one copy per layer), freed slots merge back, and no slot
is ever handed out twice or lost."""

from __future__ import annotations

import random

import pytest

from tokenmill.core.host_slot_runs import FreeSlotRuns


def test_successive_takes_are_adjacent_and_gives_merge_back() -> None:
    free = FreeSlotRuns(10)
    assert free.take(3) == [0, 1, 2]
    assert free.take(2) == [3, 4]  # a request's head evicted a step after its tail: side by side
    assert free.runs == [(5, 10)] and free.num_free == 5
    free.give([1])
    free.give([3])
    assert free.runs == [(1, 2), (3, 4), (5, 10)]
    free.give([2])  # joins both neighbours
    assert free.runs == [(1, 4), (5, 10)]
    free.give([4, 0])  # two runs of one slot: joins left, and right
    assert free.runs == [(0, 10)] and free.num_free == 10
    free.check_invariants()


def test_the_first_run_long_enough_is_used_else_the_longest_runs() -> None:
    free = FreeSlotRuns(12)
    free.take(12)
    free.give([0, 1, 4, 5, 6, 9])
    assert free.take(3) == [4, 5, 6]  # the lowest run that holds all three, not split over 0-1 and 9
    free.give([4, 5, 6])
    # No run holds 5: the longest (4-6) whole, then the next longest (0-1), none split needlessly.
    assert free.take(5) == [4, 5, 6, 0, 1]
    assert free.runs == [(9, 10)]
    free.give([0, 1, 2, 3])
    # Partly taken run: the rest stays free.
    assert free.take(5) == [0, 1, 2, 3, 9]
    assert free.runs == [] and free.num_free == 0
    free.check_invariants()


def test_taking_more_than_is_free_hands_out_what_there_is() -> None:
    free = FreeSlotRuns(4)
    assert free.take(0) == []
    assert sorted(free.take(6)) == [0, 1, 2, 3]
    assert free.take(1) == [] and free.num_free == 0
    assert FreeSlotRuns(0).take(1) == []


def test_a_double_free_or_a_slot_out_of_range_is_refused() -> None:
    free = FreeSlotRuns(6)
    free.take(4)
    with pytest.raises(ValueError, match=r"host slots \[4, 5\) are freed twice"):
        free.give([4])
    free.give([1])
    with pytest.raises(ValueError, match=r"host slots \[0, 2\) are freed twice"):
        free.give([0, 1])
    with pytest.raises(ValueError, match=r"host slots \[6, 7\) are outside the tier's 6 slots"):
        free.give([6])
    with pytest.raises(ValueError, match="outside"):
        free.give([-1])
    free.check_invariants()
    assert free.slots() == [1, 4, 5]


def test_random_takes_and_gives_never_lose_or_repeat_a_slot() -> None:
    rng = random.Random(4)
    free = FreeSlotRuns(64)
    held: set[int] = set()
    for _ in range(2000):
        if held and rng.random() < 0.5:
            back = rng.sample(sorted(held), rng.randint(1, min(8, len(held))))
            free.give(back)
            held -= set(back)
        else:
            want = rng.randint(1, 10)
            fits = any(end - start >= want for start, end in free.runs)
            taken = free.take(want)
            assert len(taken) == min(want, 64 - len(held))
            assert len(set(taken)) == len(taken) and not set(taken) & held
            if fits:  # one run could hold them all: one copy per layer
                assert taken == list(range(taken[0], taken[0] + want))
            held |= set(taken)
        free.check_invariants()
        assert sorted(held | set(free.slots())) == list(range(64)), "a slot was lost"
        assert not held & set(free.slots())
