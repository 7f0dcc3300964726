"""The scheduler's waiting queues: first come first served, or by priority.

A queue is the scheduling policy's seam: besides ordering, it may shed requests and watch steps
and requests end (the `slo` policy, core/slo_queue.py); these two need none of that.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.request import Request

SortKey = tuple[int, float, int]  # (priority, arrival_time, admission sequence number): lower first


@dataclass(slots=True)
class ShedRequest:
    """A waiting request the policy gives up on: it ends with finish_reason "shed" (HTTP 429)."""

    request: Request
    message: str  # why, for the client
    retry_after_s: float  # when trying again may succeed


@dataclass(slots=True)
class KVRoom:
    """What a policy needs to know about the KV pool to preempt for a waiting request's blocks."""

    free_blocks: int
    blocks_needed: Callable[[Request], int]  # to prefill a waiting request's whole prompt
    blocks_held: Callable[[Request], int]  # what preempting a running request would give back


class PolicyHooks:
    """What the scheduler tells its waiting queue beyond add / pop; nothing, by default."""

    # Keep `running` in the queue's key order (priority first), so that the tail, the victim of a
    # preemption, is the lowest-priority, latest-arrived request; False: admission order.
    orders_running_by_priority = False

    def step_scheduled(self) -> None:
        """schedule() has begun a step."""

    def take_hopeless(self, num_running: int) -> list[ShedRequest]:
        """Waiting requests to end now instead of admitting, already out of the queue."""
        return []

    def preempt_for_waiting(
        self, running: Sequence[Request], max_num_seqs: int, kv_room: KVRoom | None = None
    ) -> list[Request]:
        """Running requests to preempt (recompute later) before this step, so that waiting ones the
        policy ranks above them take their seats (and, given `kv_room`, their KV blocks) now; from
        `running`'s tail."""
        return []

    def running_prefill_chunk(self, request: Request, num_new: int, prefill_room: int, num_running: int) -> int:
        """How many of the `num_new` prompt tokens (already within `prefill_room`) a running
        request still prefilling computes this step, `num_running` requests running; 0: none, it
        waits a step. The default: all of them."""
        return num_new

    def joins_step(self, request: Request, admitted: Sequence[Request], step_tokens: int) -> bool:
        """May the queue's head join a step that already admitted `admitted` (non-empty) and
        schedules `step_tokens` tokens so far? False: it and everything behind it wait for a later step."""
        return True

    def step_finished(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """A step's results were applied (update_from_output), one call per schedule(), in order."""

    def request_finished(self, request: Request) -> None:
        """A live request ended, any way (its status says which)."""

    def stats(self) -> dict[str, float]:
        return {}


class FcfsQueue(PolicyHooks):
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


class PriorityQueue(PolicyHooks):
    """Waiting requests by (priority, arrival time); preempted ones keep their original place."""

    orders_running_by_priority = True

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
