"""The host KV tier's free slots, kept as runs of consecutive slots so a step's saves get few runs.

The worker copies each run of consecutive host slots of a layer in one call (worker/kv_connector/
host_tier.py), so the number of copies a step costs is the number of runs its slots form. The
allocator hands a step's saves one run where one is long enough (the lowest such: the blocks a
request's tail and head evicted in successive steps then sit side by side), else the longest runs
first; freed slots merge back with their neighbours. Torch-free (the scheduler's side).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable


class FreeSlotRuns:
    """Free slots as disjoint, non-adjacent runs [start, end), sorted by start."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._starts: list[int] = [0] if num_slots else []
        self._ends: list[int] = [num_slots] if num_slots else []
        self.num_free = num_slots

    @property
    def runs(self) -> list[tuple[int, int]]:
        """The free runs as (start, end), in slot order (tests, stats)."""
        return list(zip(self._starts, self._ends, strict=True))

    def take(self, count: int) -> list[int]:
        """min(count, free) slots, ascending within each run, in as few runs as this greedy finds:
        the first run long enough for all of them, else whole runs longest first."""
        count = min(count, self.num_free)
        if count <= 0:
            return []
        starts, ends = self._starts, self._ends
        for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
            if end - start >= count:
                self._cut(i, count)
                return list(range(start, start + count))
        slots: list[int] = []
        emptied: set[int] = set()
        for i in sorted(range(len(starts)), key=lambda j: starts[j] - ends[j]):  # longest first
            take = min(count - len(slots), ends[i] - starts[i])
            slots.extend(range(starts[i], starts[i] + take))
            if take == ends[i] - starts[i]:
                emptied.add(i)
            else:  # the last run taken, and only partly: indices stay valid
                starts[i] += take
            if len(slots) == count:
                break
        self._starts = [s for i, s in enumerate(starts) if i not in emptied]
        self._ends = [e for i, e in enumerate(ends) if i not in emptied]
        self.num_free -= count
        return slots

    def _cut(self, index: int, count: int) -> None:
        """Take `count` slots off the head of run `index` (fewer than its length, or all of it)."""
        self._starts[index] += count
        self.num_free -= count
        if self._starts[index] == self._ends[index]:
            del self._starts[index]
            del self._ends[index]

    def give(self, slots: Iterable[int]) -> None:
        """Free `slots` (none of them free now), merging runs that touch."""
        ordered = sorted(slots)
        i = 0
        while i < len(ordered):
            j = i + 1
            while j < len(ordered) and ordered[j] == ordered[j - 1] + 1:
                j += 1
            self._give_run(ordered[i], ordered[j - 1] + 1)
            i = j

    def _give_run(self, start: int, end: int) -> None:
        if not 0 <= start < end <= self.num_slots:
            raise ValueError(f"host slots [{start}, {end}) are outside the tier's {self.num_slots} slots")
        starts, ends = self._starts, self._ends
        i = bisect_left(starts, start)
        if (i > 0 and ends[i - 1] > start) or (i < len(starts) and starts[i] < end):
            raise ValueError(f"host slots [{start}, {end}) are freed twice")
        self.num_free += end - start
        merge_left = i > 0 and ends[i - 1] == start
        merge_right = i < len(starts) and starts[i] == end
        if merge_left and merge_right:
            ends[i - 1] = ends[i]
            del starts[i]
            del ends[i]
        elif merge_left:
            ends[i - 1] = end
        elif merge_right:
            starts[i] = start
        else:
            starts.insert(i, start)
            ends.insert(i, end)

    def slots(self) -> list[int]:
        """Every free slot (tests and invariant checks)."""
        return [slot for start, end in self.runs for slot in range(start, end)]

    def check_invariants(self) -> None:
        runs = self.runs
        assert all(0 <= s < e <= self.num_slots for s, e in runs), "a free host slot run is empty or out of range"
        assert all(a[1] < b[0] for a, b in zip(runs, runs[1:], strict=False)), (
            "free host slot runs overlap, touch or are out of order"
        )
        assert self.num_free == sum(e - s for s, e in runs), "the free host slot count is off"
