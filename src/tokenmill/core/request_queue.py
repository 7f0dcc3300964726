"""The scheduler's waiting queues: first come first served, or by priority."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from tokenmill.core.request import Request

SortKey = tuple[int, float, int]  # (priority, arrival_time, admission sequence number): lower first


class FcfsQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request, key: SortKey) -> None:
        self._queue.append(request)

    def add_preempted(self, request: Request, key: SortKey) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request_ids: set[str]) -> None:
        self._queue = deque(r for r in self._queue if r.request_id not in request_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Waiting requests by (priority, arrival time); preempted ones keep their original place."""

    def __init__(self) -> None:
        self._heap: list[tuple[SortKey, Request]] = []

    def add(self, request: Request, key: SortKey) -> None:
        heapq.heappush(self._heap, (key, request))

    add_preempted = add

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request_ids: set[str]) -> None:
        self._heap = [entry for entry in self._heap if entry[1].request_id not in request_ids]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[1] for entry in self._heap)
