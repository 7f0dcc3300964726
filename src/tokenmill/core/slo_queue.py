"""The `slo` scheduling policy: least slack first, and shed early what can no longer make it.

Each request has latency targets (tokenmill/slo.py): time to first token (TTFT) and mean time per
output token (TPOT). Goodput is the number of requests that finish within theirs; this queue
orders and sheds to maximise it:

- Order: by priority (lower first, as the priority policy), then earliest *latest start* first,
  where latest start = arrival + TTFT target - predicted prefill time of its prompt (the
  prediction comes from measured step costs, core/step_cost.py). Within a priority that is least
  slack first (slack = latest start - now, the same `now` for everyone). Priority goes first so
  that a high-priority class's targets hold under overload: the lower classes are the ones that
  wait and get shed. Requests with no TTFT target come after every one of their priority with a
  target, in arrival order. Preempted requests keep their place.
- Shed: each step, walking the queue in that order and adding up the prompt tokens that would be
  prefilled before each request, a request whose predicted first token (now + those prefills
  + its own, in steps of the token budget that also carry the running batch's decodes) is past
  its TTFT deadline is ended with finish_reason "shed" (the server answers 429 with
  Retry-After). Only requests that have not produced a token are shed: one that streamed
  tokens (even if preempted since) is never shed. Nothing is shed until the cost model has seen
  enough steps to predict.
- Preempt: a waiting request with a TTFT target that would miss its latest start waiting for a
  seat, or for its prompt's KV blocks, takes the seat (and blocks) of the lowest-class running
  request of a strictly lower class, which recomputes later (preempt_for_waiting). Running
  requests are kept in priority order.
- Keep a first token's step short: a lower class does not join a step that prefills a higher
  class's first token when it would push that step past the token's deadline (joins_step), and a
  lower class's running prompt chunk leaves room for that first token's whole prompt
  (running_prefill_chunk).

It also counts, per SLO class, the requests that completed within their targets (goodput),
missed them, or were shed; the engine reports these in its stats (tokenmill/slo_metrics.py).
TTFT and TPOT are measured here, when the engine gets each token back: a few milliseconds
earlier than a client sees them.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

from tokenmill.config import SchedulerConfig
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import KVRoom, PolicyHooks, ShedRequest, SortKey
from tokenmill.core.step_cost import StepCostModel, StepTimer
from tokenmill.slo import SloTarget, resolve_target

_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
COLD_STEPS = 8  # the engine's first steps, left out of the step cost fit

# Engine stats keys (absolute totals); ".<class>" follows the per-class ones.
GOODPUT_KEY = "slo_goodput_requests"
ATTAINED_KEY = "slo_attained_requests"
MISSED_KEY = "slo_missed_requests"
SHED_KEY = "slo_shed_requests"


class SloQueue(PolicyHooks):
    # Running requests by priority: a preemption (for KV or for a seat) takes the lowest class first.
    orders_running_by_priority = True

    def __init__(
        self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic, cost: StepCostModel | None = None
    ) -> None:
        self.slo = config.slo
        self.token_budget = config.max_num_batched_tokens or 2048
        self.max_num_seqs = config.max_num_seqs
        # While anything decodes a step prefills at most this many tokens (0: the whole budget).
        self.prefill_cap = config.max_prefill_tokens_while_decoding or 0
        self.max_model_len = config.max_model_len
        self.clock = clock
        # A new engine's first steps are cold (first touches of the weights' pages, buffers growing):
        # on the CPU benchmark's servers steps 0-5 took 2-10x their warm time (0.5-1.5 s), and a fit
        # that kept them predicted prefills far too slow and shed requests that would have made it.
        self.cost = cost if cost is not None else StepCostModel(skip_steps=COLD_STEPS)
        self.timer = StepTimer(clock)
        # (priority, latest start, arrival time if no TTFT target, sequence number, request),
        # sorted: the head is scheduled first.
        self._entries: list[tuple[int, float, float, int, Request]] = []
        self._sequence = itertools.count()
        self._latest_start: dict[str, float] = {}
        self.targets: dict[str, SloTarget] = {}  # every live request this queue has seen
        self._first_token_at: dict[str, float] = {}
        self.goodput = 0
        self.attained: Counter[str] = Counter()
        self.missed: Counter[str] = Counter()
        self.shed: Counter[str] = Counter()

    # -- the queue --------------------------------------------------------------------------

    def target(self, request: Request) -> SloTarget:
        target = self.targets.get(request.request_id)
        if target is None:
            params = request.sampling_params
            target = resolve_target(self.slo, request.priority, params.slo_ttft_ms, params.slo_tpot_ms)
            self.targets[request.request_id] = target
        return target

    def add(self, request: Request, key: SortKey) -> None:
        latest_start = self._latest_start.get(request.request_id)
        if latest_start is None:
            target = self.target(request)
            if target.ttft_s is None:
                latest_start = math.inf
            else:
                prefill = self.cost.seconds_for(request.num_tokens, self.token_budget)
                latest_start = request.arrival_time + target.ttft_s - prefill
            self._latest_start[request.request_id] = latest_start
        # Requests with no target (inf) among themselves: by arrival.
        order = request.arrival_time if latest_start == math.inf else 0.0
        entry = (request.priority, latest_start, order, next(self._sequence), request)
        bisect.insort(self._entries, entry, key=_sort_key)

    add_preempted = add  # keeps its latest start, so its place

    def peek(self) -> Request:
        return self._entries[0][-1]

    def pop(self) -> Request:
        return self._entries.pop(0)[-1]

    def remove(self, request_ids: set[str]) -> None:
        self._entries = [e for e in self._entries if e[-1].request_id not in request_ids]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in self._entries)

    # -- shedding ---------------------------------------------------------------------------

    def step_scheduled(self) -> None:
        self.timer.scheduled()

    def take_hopeless(self, num_running: int) -> list[ShedRequest]:
        if not self.cost.ready or not self._entries:
            return []
        now = self.clock()
        cost, budget = self.cost, self.token_budget
        kept: list[tuple[int, float, float, int, Request]] = []
        hopeless: list[tuple[Request, float]] = []
        tokens_ahead = 0
        for entry in self._entries:
            request = entry[-1]
            own = request.num_tokens - request.num_computed_tokens
            target = self.targets[request.request_id]
            if target.ttft_s is not None and request.num_output_tokens == 0:
                first_token_at = now + cost.seconds_for(tokens_ahead + own, budget, num_running, self.prefill_cap)
                deadline = request.arrival_time + target.ttft_s
                if first_token_at > deadline:
                    hopeless.append((request, first_token_at - now))
                    continue
            tokens_ahead += own
            kept.append(entry)
        if not hopeless:
            return []
        self._entries = kept
        # The queue that stays drains in about this long: a retry before that meets the same queue.
        retry_after = max(1.0, math.ceil(cost.seconds_for(tokens_ahead, budget, num_running, self.prefill_cap)))
        return [
            ShedRequest(
                request,
                f"shed by the SLO scheduler: its first token was predicted in {predicted:.2f} s, after its "
                f"time-to-first-token target of {self.targets[request.request_id].ttft_s * 1000:g} ms "
                f"({now - request.arrival_time:.2f} s already waited); the server is overloaded, retry after "
                f"{retry_after:g} s or send a looser slo_ttft_ms",
                retry_after,
            )
            for request, predicted in hopeless
        ]

    # -- preempting for a seat ----------------------------------------------------------------

    def preempt_for_waiting(
        self, running: Sequence[Request], max_num_seqs: int, kv_room: KVRoom | None = None
    ) -> list[Request]:
        """Lower-class running requests to preempt so that urgent waiting ones start this step.

        Walking the queue in its order, the first waiting requests take the free seats; each one
        after that is *urgent* when the seat it would otherwise wait for (the k-th running request
        to finish, at the predicted decode step time) frees after its latest start. An urgent
        request that has a TTFT target and no token yet takes the seat of the lowest-class,
        latest-admitted running request of a strictly lower class (the tail of `running`, which
        this policy keeps in priority order), which recomputes later. With `kv_room`, a request
        also needs the KV blocks of its prompt: one that has a seat but not the blocks, and would
        wait for them past its latest start (blocks free as running requests end, like seats),
        preempts lower-class requests until their blocks cover it. The walk stops at the first
        request that does not get a seat (and its blocks) now, so the queue's order holds: nothing
        jumps ahead of it. Before the cost model is ready every such request counts as urgent.
        """
        free_seats = max_num_seqs - len(running)
        if not running or (len(self._entries) <= free_seats and kv_room is None):
            return []
        now = self.clock()
        ready = self.cost.ready
        # When the running requests free their seats (and blocks) by themselves, soonest first.
        step_s = self.cost.seconds_for(len(running), self.token_budget) if ready else 0.0
        natural_seats = sorted(self._decode_steps_left(r) * step_s for r in running)
        candidates = list(reversed(running))  # the victims, in the order they would go
        victims: list[Request] = []
        free_blocks = kv_room.free_blocks if kv_room is not None else 0
        num_natural = 0  # natural seats already given to requests ahead in the queue
        for _, latest_start, _, _, request in self._entries:
            seat_in = natural_seats[num_natural] if num_natural < len(natural_seats) else math.inf
            can_wait = ready and now + seat_in <= latest_start
            target = self.targets[request.request_id]
            may_preempt = target.ttft_s is not None and request.num_output_tokens == 0
            if free_seats > 0:
                free_seats -= 1
            else:
                if can_wait or not may_preempt or not candidates or candidates[0].priority <= request.priority:
                    break  # it waits for a seat (only a strictly lower class gives one up); so does the rest
                victim = candidates.pop(0)
                victims.append(victim)
                if kv_room is not None:
                    free_blocks += kv_room.blocks_held(victim)
            if kv_room is None:
                continue
            needed = kv_room.blocks_needed(request)
            while free_blocks < needed:
                if can_wait or not may_preempt or not candidates or candidates[0].priority <= request.priority:
                    return victims  # it waits for blocks; so does everything behind it
                victim = candidates.pop(0)
                victims.append(victim)
                free_blocks += kv_room.blocks_held(victim)
                free_seats += 1  # the victim's seat is free for the requests behind
            free_blocks -= needed
        return victims

    def running_prefill_chunk(self, request: Request, num_new: int, prefill_room: int, num_running: int) -> int:
        """A lower class's prompt chunk leaves a waiting higher class's first token (the queue's
        head: a TTFT target, no token yet, a free seat) the room for its whole prompt this step,
        and takes what is left only if the step still ends by that token's deadline (before the
        cost model is ready: nothing). Running chunks are scheduled before any admission: without
        this a half-prefilled batch prompt takes the step's prefill room (the CPU server's
        --max-prefill-tokens-while-decoding, 128) and the interactive prompt is split over two
        steps, its first token a whole prefill step later (the benchmark's trace, BENCHMARKS.md
        issue 20, pass A). The chunk waits a step; its request keeps its seat and blocks."""
        if not self._entries or num_running >= self.max_num_seqs:
            return num_new  # no head, or no seat for it this step: the chunk delays nothing
        head = self._entries[0][-1]
        ttft_s = self.targets[head.request_id].ttft_s
        if head.priority >= request.priority or ttft_s is None or head.num_output_tokens:
            return num_new
        head_tokens = head.num_tokens - head.num_computed_tokens
        keep = min(num_new, max(prefill_room - head_tokens, 0))
        if keep and self.cost.ready:
            # The step: the running requests' decodes (about one token each), this chunk, the head's prompt.
            step_ends = self.clock() + self.cost.seconds_for(num_running + keep + head_tokens, self.token_budget)
            if step_ends <= head.arrival_time + ttft_s:
                return keep
        return 0

    def joins_step(self, request: Request, admitted: Sequence[Request], step_tokens: int) -> bool:
        """A lower class does not join a step that prefills a higher class's first token (a TTFT
        target, no token yet) when its prefill would make that step end past that token's deadline:
        on a CPU one 100-token prompt can cost more than the decodes of the whole batch. It waits
        one step (the next one carries the higher class's first decode, not its prefill). Before
        the cost model is ready it always waits."""
        at_stake = [
            other
            for other in admitted
            if other.priority < request.priority
            and other.num_output_tokens == 0
            and self.targets[other.request_id].ttft_s is not None
        ]
        if not at_stake:
            return True
        if not self.cost.ready:
            return False
        own = min(request.num_tokens - request.num_computed_tokens, self.token_budget - step_tokens)
        step_ends = self.clock() + self.cost.seconds_for(step_tokens + own, self.token_budget)
        return all(
            step_ends <= other.arrival_time + self.targets[other.request_id].ttft_s for other in at_stake
        )

    def _decode_steps_left(self, request: Request) -> int:
        """Steps until it ends by length (it may stop earlier on EOS or a stop token)."""
        left = self.max_model_len - request.num_tokens
        if request.max_tokens is not None:
            left = min(left, request.max_tokens - request.num_output_tokens)
        return max(left, 0)

    # -- measuring --------------------------------------------------------------------------

    def step_finished(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        seconds = self.timer.finished()
        if seconds is not None and scheduler_output.total_num_scheduled_tokens:
            self.cost.observe(scheduler_output.total_num_scheduled_tokens, seconds)
        if not runner_output.req_ids:
            return
        now = self.clock()
        first = self._first_token_at
        targets = self.targets
        for request_id, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            if token_ids and request_id not in first and request_id in targets:
                first[request_id] = now

    def request_finished(self, request: Request) -> None:
        request_id = request.request_id
        target = self.targets.pop(request_id, None)
        self._latest_start.pop(request_id, None)
        first_token_at = self._first_token_at.pop(request_id, None)
        if target is None:
            return  # ended before it was ever queued (refused by the scheduler)
        if request.status == RequestStatus.FINISHED_SHED:
            self.shed[target.slo_class] += 1
            self.missed[target.slo_class] += 1
            return
        if request.status not in _COMPLETED or first_token_at is None:
            return  # aborted or failed: the client or the model ended it, not the schedule
        now = self.clock()
        num_output = request.num_output_tokens
        tpot = (now - first_token_at) / (num_output - 1) if num_output > 1 else None
        if target.met(first_token_at - request.arrival_time, tpot):
            self.attained[target.slo_class] += 1
            self.goodput += 1
        else:
            self.missed[target.slo_class] += 1

    def stats(self) -> dict[str, float]:
        overhead, per_token = self.cost.coefficients()
        stats: dict[str, float] = {
            GOODPUT_KEY: self.goodput,
            "slo_step_overhead_seconds": overhead,
            "slo_step_seconds_per_token": per_token,
        }
        for key, counts in ((ATTAINED_KEY, self.attained), (MISSED_KEY, self.missed), (SHED_KEY, self.shed)):
            for slo_class, count in counts.items():
                stats[f"{key}.{slo_class}"] = count
        return stats


def _sort_key(entry: tuple[int, float, float, int, Request]) -> tuple[int, float, float, int]:
    return entry[0], entry[1], entry[2], entry[3]
