"""The continuous-batching scheduler: which requests compute how many tokens each step.

There are no prefill and decode phases. Each step every running request, then every waiting one,
gets `num_tokens - num_computed_tokens` tokens to compute, capped by what is left of the step's
token budget (so long prompts are chunked) and by max_model_len, while `max_num_seqs` and the KV
blocks allow. When blocks run out, the lowest-priority running request (the latest, under FCFS)
is preempted: its blocks are freed and it is recomputed later. The waiting queue is the
scheduling policy's seam (core/request_queue.py): fcfs, priority, or slo (core/slo_queue.py), which
also sheds waiting requests that can no longer meet their latency targets (finish reason "shed"),
preempts lower classes for urgent waiting requests before a step, and holds lower classes out of a
step that prefills a tight first token.

Contract with the engine: call `update_from_output` once for every `schedule()`, in order, also
when the output is empty (with an empty ModelRunnerOutput): it returns the outputs of requests
that `schedule()` itself had to end (ones that can never fit in the KV pool).

Async scheduling: the engine may call `schedule()` for step N+1 before `update_from_output` of
step N, while step N runs on the device. A request that samples in step N then has an output
placeholder: step N+1 computes the token step N sampled (the runner feeds it on the device), and
its id reaches the host with step N's results. A request whose in-flight token is its last by
length is not scheduled again; one that stops on EOS or a stop token wastes one step's row.

Draft tokens (speculative decoding): a request's `spec_token_ids` are scheduled as extra tokens
after its last known one, within the budget, with lookahead KV slots reserved for them. The
runner returns 1..k+1 tokens for k drafts (the accepted ones and one more); `update_from_output`
appends them one by one under the stop conditions and rolls `num_computed_tokens` back over the
rejected drafts, whose KV is garbage. Drafts are not scheduled while a token is in flight.

Structured output (see core/structured_output.py): a constrained request waits in
WAITING_FOR_GRAMMAR, outside the queue, until its grammar compiles; each step lists the
constrained requests that sample, and each token they get passes their grammar.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.kv_cache_groups import KVCacheGroups
from tokenmill.core.kv_cache_manager import GroupBlockIds, KVCacheManager
from tokenmill.core.kv_connector import KVConnectorScheduler, check_kv_cache_groups
from tokenmill.core.kv_connector_metadata import KVConnectorMetadata
from tokenmill.core.lora_admission import LoRAAdmission, LoRAHooks
from tokenmill.core.outputs import (
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
)
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import FcfsQueue, KVRoom, PriorityQueue, SortKey
from tokenmill.core.slo_queue import SloQueue
from tokenmill.core.step_cost import PrefillDecodeCostModel, StepTimer
from tokenmill.core.structured_output import StructuredOutputHooks
from tokenmill.spec_decode.stats import SpecDecodingStats

# The engine's first steps, left out of the prefill step-time fit (as the slo policy's).
COLD_STEPS = 8
# While requests decode, prefill_step_target_ms trims a step's prompt tokens below the cap
# (max_prefill_tokens_while_decoding) but never below this many (or the cap, if smaller): a closed
# loop whose prompts are as long as its answers must prefill about one prompt token per decoding
# stream a step, or its queue of prompts grows without end (at c=32, 16 a step gave a TTFT p50 of
# 18 s; docs/CPU_PERFORMANCE.md). 32 was the CPU's fixed cap before the target trimmed it.
MIN_PREFILL_TOKENS_WHILE_DECODING = 32

# `_check_stop`'s verdict when the grammar has not been asked about the token yet.
_NOT_ACCEPTED = object()


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_kv_blocks: int,
        structured_output: StructuredOutputHooks | None = None,
        kv_cache_groups: KVCacheGroups | None = None,
        num_speculative_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        lora: LoRAHooks | None = None,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        """`kv_cache_groups`: the model's layers grouped by attention type (None: one full group).
        `num_speculative_tokens`: speculative decoding's k (0: off); `num_lookahead_tokens`: KV
        slots reserved after a decoding request's scheduled tokens (a draft model writes its
        proposals' KV there). `lora`: LoRA's admission hooks (None: LoRA off). `kv_connector`:
        KV kept outside the device pool (core/kv_connector.py; None: none, and no call is made)."""
        if scheduler_config.policy not in _WAITING_QUEUES:
            raise ValueError(
                f"scheduling policy must be one of {', '.join(_WAITING_QUEUES)}, got {scheduler_config.policy!r}"
            )
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.kv = KVCacheManager(
            num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching, kv_cache_groups
        )
        self.requests: dict[str, Request] = {}  # every live (unfinished) request
        # The policy's seam: its queue orders the waiting requests and may shed some (slo).
        self.waiting: FcfsQueue | PriorityQueue | SloQueue = _WAITING_QUEUES[scheduler_config.policy](scheduler_config)
        # Running requests, highest priority first (FCFS: in admission order): the tail is the victim.
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self._keys: dict[str, SortKey] = {}
        self._sequence = itertools.count()
        self._finished_req_ids: set[str] = set()  # since the previous schedule()
        self._pending_outputs: list[EngineCoreOutput] = []  # requests schedule() had to end
        # Requests of the last schedule() whose step was neither launched (`launched`) nor
        # reported (`update_from_output`): if one ends now its KV may never be written.
        self._unlaunched: set[str] = set()
        self._prompt_logprobs_sent: dict[str, int] = {}  # prompt positions already emitted
        self.structured_output = structured_output
        # Constrained requests whose grammar is still compiling, in arrival order.
        self.waiting_for_grammar: list[Request] = []
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_stats = SpecDecodingStats(num_speculative_tokens) if num_speculative_tokens else None
        self.lora = lora
        self.kv_connector = kv_connector
        # prefill_step_target_ms: a step's prefill beyond its first chunk is bounded by the tokens
        # the cost model learned from the steps' (prefill tokens, decode rows, seconds) predicts fit
        # in the target. 0: off (no model, no timing).
        target_ms = scheduler_config.prefill_step_target_ms or 0.0
        self.prefill_step_target_s = target_ms / 1000.0
        self.step_cost: PrefillDecodeCostModel | None = None
        if target_ms > 0:
            # A new engine's first steps are cold (first touches of the weights, buffers growing): out of the fit.
            self.step_cost = PrefillDecodeCostModel(skip_steps=COLD_STEPS)
            self._step_timer = StepTimer()
            self._step_mix: deque[tuple[int, int]] = deque()  # (prefill tokens, decode rows) of steps in flight
        if kv_connector is not None:
            check_kv_cache_groups(self.kv.groups)
            self.kv.pool.on_evict = kv_connector.on_blocks_evicted

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use by a live request")
        request.status = RequestStatus.WAITING
        key = (request.priority, request.arrival_time, next(self._sequence))
        self._keys[request.request_id] = key
        self.requests[request.request_id] = request
        if request.sampling_params.kv_transfer_id is not None and not (
            self.kv_connector is not None and self.kv_connector.accepts_transfer_ids
        ):
            self._end_outside_queues(
                request, "kv_transfer_params needs an engine started with --kv-role producer or consumer; leave it out"
            )
            return
        if self.config.policy != "slo" and (
            request.sampling_params.slo_ttft_ms is not None or request.sampling_params.slo_tpot_ms is not None
        ):  # only the slo policy reads them: refused, not ignored (the API server refuses them first)
            self._end_outside_queues(
                request,
                f"slo_ttft_ms / slo_tpot_ms need scheduling_policy 'slo' (this engine schedules "
                f"{self.config.policy}); leave them out",
            )
            return
        if request.lora_request is not None and self.lora is None:
            self._end_outside_queues(request, "LoRA is not enabled: start the engine with --enable-lora")
            return
        if request.use_structured_output:
            if self.structured_output is None:
                self._end_outside_queues(request, "structured output is not available here")
                return
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(request)
            self.structured_output.start(request)
            return
        self.waiting.add(request, key)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """End the given live requests ("abort") and free their blocks now; unknown ids are ignored."""
        return self._end_requests(request_ids, RequestStatus.FINISHED_ABORTED, None)

    def finish_request(
        self, request_id: str, status: RequestStatus, error: str | None = None
    ) -> list[EngineCoreOutput]:
        """End one live request from outside (stop string, error); [] if it is not live."""
        if not status.is_finished:
            raise ValueError(f"finish_request needs a finished status, got {status.name}")
        return self._end_requests([request_id], status, error)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    def take_kv_connector_flush(self) -> KVConnectorMetadata | None:
        """The KV connector's queued work that may run between steps (a producer's sends: their
        blocks are not reused before the next schedule()); None when there is none."""
        if self.kv_connector is None or not self.kv_connector.has_pending_work():
            return None
        return self.kv_connector.build_connector_meta()

    def has_pending_kv_work(self) -> bool:
        """The KV connector needs a step even without requests (a producer's queued sends)."""
        return self.kv_connector is not None and self.kv_connector.has_pending_work()

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_stats(self) -> dict[str, float]:
        stats = self.spec_stats.as_stats() if self.spec_stats is not None else {}
        return stats | {
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "num_preemptions_total": self.num_preemptions_total,
            "num_running": len(self.running),
            "num_waiting": len(self.waiting) + len(self.waiting_for_grammar),
        } | self.waiting.stats() | (self.kv_connector.get_stats() if self.kv_connector is not None else {})

    # -- scheduling -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._poll_grammars()
        self.waiting.step_scheduled()
        if self.step_cost is not None:
            self._step_timer.scheduled()
        budget = self.config.max_num_batched_tokens
        output = SchedulerOutput()
        # Filled in batch order: running (cached) requests first, then admitted (new) ones.
        num_scheduled = output.num_scheduled_tokens
        cached = output.scheduled_cached_reqs
        preempted = output.preempted_req_ids
        running = self.running
        max_model_len = self.max_model_len

        if self.waiting:
            # First the policy's decisions about waiting requests (slo: shed the hopeless, then free
            # seats for urgent higher classes), before any running request is scheduled this step.
            for shed in self.waiting.take_hopeless(len(running)):
                self._end_outside_queues(shed.request, shed.message, RequestStatus.FINISHED_SHED, shed.retry_after_s)
            if self.waiting:
                kv = self.kv
                room = KVRoom(
                    kv.num_free_blocks,
                    lambda r: kv.num_blocks_needed(0, r.num_tokens),
                    lambda r: sum(kv.num_live_blocks(r.request_id)) if kv.has_blocks(r.request_id) else 0,
                )
                for victim in self.waiting.preempt_for_waiting(running, self.config.max_num_seqs, room):
                    running.remove(victim)
                    self._preempt(victim)
                    preempted.add(victim.request_id)
        num_preempted_for_policy = len(preempted)
        prefill_room, prefill_limit = self._prefill_room(budget)
        num_prefill = 0  # prompt tokens (prefill chunks) scheduled so far this step
        allocate_slots = self.kv.allocate_slots
        num_lookahead_tokens = self.num_lookahead_tokens
        structured_ids = output.structured_output_request_ids

        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            num_known = len(request.all_token_ids) + placeholders
            # The tokens in flight already reach max_tokens or max_model_len: nothing to compute.
            # (Inlined: every running request, every step.)
            if placeholders and (
                num_known >= max_model_len
                or (
                    request.max_tokens is not None
                    and len(request.output_token_ids) + placeholders >= request.max_tokens
                )
            ):
                i += 1
                continue
            drafts = request.spec_token_ids
            # Drafts follow the last known token; none while a token is still in flight (async
            # scheduling with speculative decoding would need placeholder drafts: not supported yet).
            if drafts and request.use_structured_output and not self._grammar_allows_drafts(request):
                drafts = request.spec_token_ids = []
            if drafts and not placeholders:
                if request.max_tokens is not None:  # drafts past max_tokens would be cut anyway
                    drafts = drafts[: max(request.max_tokens - request.num_output_tokens - 1, 0)]
                num_new = min(num_known + len(drafts) - num_computed, budget, max_model_len - num_computed)
                num_drafts = max(num_computed + num_new - num_known, 0)
            else:
                num_new = min(num_known - num_computed, budget, max_model_len - num_computed)
                num_drafts = 0
                if num_new > 1:  # a prefill chunk (or a recompute after preemption)
                    num_new = min(num_new, prefill_room)
                    if num_prefill:  # not the step's first chunk: within the predicted step time
                        num_new = min(num_new, max(prefill_limit - num_prefill, 0))
                    if self.waiting:  # the policy may keep room for a waiting request's prompt (slo)
                        num_new = self.waiting.running_prefill_chunk(request, num_new, prefill_room, len(running))
                    prefill_room -= num_new
                    num_prefill += num_new
            if num_new <= 0:  # nothing to compute until a sampled token comes back
                i += 1
                continue
            lookahead = num_drafts + num_lookahead_tokens if num_computed + num_new >= num_known else 0
            if lookahead:
                new_block_ids = allocate_slots(request, num_new - num_drafts, None, lookahead)
            else:
                new_block_ids = allocate_slots(request, num_new)
            if new_block_ids is None:
                new_block_ids = self._preempt_until_allocated(request, num_new, num_drafts, lookahead, preempted)
                if new_block_ids is None:
                    continue  # it was preempted or ended; it left `running`, which ends the loop
            request_id = request.request_id
            if drafts:
                if num_drafts:
                    output.scheduled_spec_decode_tokens[request_id] = drafts[:num_drafts]
                request.spec_token_ids = []  # the request moves on: unscheduled drafts are stale
            # The runner holds its state: send only what changed. (Inlined: this runs for every
            # running request every step.)
            cached.request_ids.append(request_id)
            cached.num_computed_tokens.append(num_computed)
            if new_block_ids:
                cached.new_block_ids[request_id] = new_block_ids
            if num_computed + num_new >= num_known:  # the chunk samples: the id comes with the results
                request.num_output_placeholders = placeholders + 1
                if request.use_structured_output:
                    structured_ids.append(request_id)
            request.num_computed_tokens = num_computed + num_new  # progress counts at schedule time
            num_scheduled[request_id] = num_new
            budget -= num_new
            i += 1

        # Admitting new work right after preempting for KV would only thrash (a policy's preemptions
        # above were made to admit).
        no_kv_preemption = len(preempted) == num_preempted_for_policy
        lora = self._lora_admission() if self.waiting else None
        skipped: list[Request] = []  # waiting on their adapter or KV: back in the queue, in order, after
        admitted: list[Request] = []
        while (
            no_kv_preemption
            and self.waiting
            and min(budget, prefill_room) > 0
            and (not num_prefill or num_prefill < prefill_limit)
            and len(running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            if admitted and not self.waiting.joins_step(
                request, admitted, self.config.max_num_batched_tokens - budget
            ):
                break
            if self.kv_connector is not None and self.kv_connector.waits_for_transfer(request):
                self.waiting.pop()  # its KV is on its way: the requests behind it go first
                skipped.append(request)
                continue
            if lora is not None and request.lora_request is not None:
                adapter = lora.admit(request.lora_request)  # True, False (not yet) or why never
                if adapter is not True:
                    self.waiting.pop()
                    if adapter is False:
                        skipped.append(request)
                    else:
                        self._end_outside_queues(request, adapter)
                    continue
            if request.num_tokens > self.max_model_len:  # the engine should have refused it
                self.waiting.pop()
                self._end_outside_queues(
                    request,
                    f"the request has {request.num_tokens} tokens, more than max_model_len "
                    f"({self.max_model_len}); shorten the prompt",
                )
                continue
            hit_ids, num_hit_tokens = self.kv.get_computed_blocks(request)
            # Tokens right after the local hit that the KV connector loads (no budget: not computed).
            num_external = 0
            if self.kv_connector is not None and self.kv.uses_prefix_cache(request):
                num_external = self.kv_connector.get_num_new_matched_tokens(request, num_hit_tokens)
            num_start = num_hit_tokens + num_external
            num_new = min(request.num_tokens - num_start, budget, prefill_room)
            if num_prefill:  # not the step's first chunk: within the predicted step time
                num_new = min(num_new, prefill_limit - num_prefill)
            # A chunk that samples reserves the lookahead slots a draft model writes after it.
            lookahead = self.num_lookahead_tokens if num_start + num_new >= request.num_tokens else 0
            new_block_ids = self.kv.allocate_slots(request, num_external + num_new, hit_ids, lookahead)
            if new_block_ids is None:
                if running:
                    break  # wait for running requests to free blocks
                # Every block is free and it still does not fit: it never will.
                self.waiting.pop()
                self._end_outside_queues(
                    request, self._too_big_message(request, num_hit_tokens, num_external + num_new)
                )
                continue
            self.waiting.pop()
            if num_external:
                block_size = self.kv.block_size
                self.kv_connector.update_state_after_alloc(  # type: ignore[union-attr]
                    request, num_hit_tokens // block_size, new_block_ids[0][: num_external // block_size]
                )
            request.status = RequestStatus.RUNNING
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_start
            request.num_computed_tokens = num_start
            if self.waiting.orders_running_by_priority:
                keys = self._keys
                bisect.insort(running, request, key=lambda r: keys[r.request_id])
            else:
                running.append(request)
            output.scheduled_new_reqs.append(
                self._schedule_new(request, num_new, output.structured_output_request_ids)
            )
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            prefill_room -= num_new
            num_prefill += num_new
            admitted.append(request)

        for request in reversed(skipped):
            self.waiting.add_preempted(request, self._keys[request.request_id])
        output.total_num_scheduled_tokens = self.config.max_num_batched_tokens - budget
        if self.step_cost is not None:
            self._step_mix.append((num_prefill, output.total_num_scheduled_tokens - num_prefill))
        output.finished_req_ids = self._finished_req_ids
        self._finished_req_ids = set()
        self._unlaunched = set(num_scheduled)
        if self.kv_connector is not None:
            output.kv_connector_metadata = self.kv_connector.build_connector_meta()
        return output

    def _prefill_room(self, budget: int) -> tuple[int, int]:
        """(room, limit) for this step's prefill chunks (partial prefills, admitted prompts,
        recomputes). `room` bounds them all together: the whole budget, or
        max_prefill_tokens_while_decoding (the cap) where a running request is past its prompt
        (decoding). `limit` bounds them together once the step has its first chunk: with
        prefill_step_target_ms and a step-cost model that has seen enough steps, the most prompt
        tokens predicted to keep the step (beside its decoding rows) within the target, never below
        the cap; else the room. So a single prompt is never split by the target while nothing
        decodes, and prompts that arrive together then finish their prefills in different steps,
        not all in one long step (their first tokens come sooner and, where their answers are as
        long, those do not all end, and get replaced, in one step).

        While requests decode, the target trims the cap itself (room and limit both): the prompt
        tokens predicted to fit beside the decoding rows, never below
        MIN_PREFILL_TOKENS_WHILE_DECODING (or the cap, if smaller). A fast machine then prefills up
        to the cap a step (fewer steps, each reading the weights once, and fuller decode batches
        sooner), a slow one keeps its steps, and so the inter-token gaps, near the target."""
        cap = self.config.max_prefill_tokens_while_decoding or 0
        cost = self.step_cost
        measured = cost is not None and cost.ready
        decodes = (r.num_computed_tokens >= r.num_prompt_tokens for r in self.running)
        # The cost model needs how many decode; otherwise whether any does (stops at the first).
        num_decoding = sum(decodes) if measured else int(any(decodes))
        capped = bool(cap) and bool(num_decoding)
        room = min(cap, budget) if capped else budget
        if not measured:
            return room, room
        fits = cost.prefill_tokens_within(self.prefill_step_target_s, num_decoding)
        if capped:
            room = min(room, max(fits, MIN_PREFILL_TOKENS_WHILE_DECODING))
            return room, room
        if room <= cap:
            return room, room
        return room, min(max(fits, cap, 1), room)

    def _lora_admission(self) -> LoRAAdmission | None:
        if self.lora is None:
            return None
        active = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        return LoRAAdmission(self.lora, active)

    def step_failed(self, scheduler_output: SchedulerOutput) -> None:
        """The step failed as a whole (its requests end as errored): the KV connector forgets what
        its copies would have stored."""
        if self.kv_connector is not None and scheduler_output.kv_connector_metadata is not None:
            self.kv_connector.step_failed(scheduler_output.kv_connector_metadata)

    def launched(self, scheduler_output: SchedulerOutput) -> None:
        """The runner has queued this step's work on the device: its KV writes happen before any
        later step's, even if its requests end now, so their full blocks may stay in the prefix
        cache (async scheduling ends requests while their last step is in flight)."""
        self._unlaunched.difference_update(scheduler_output.num_scheduled_tokens)

    def _poll_grammars(self) -> None:
        """Move requests whose grammar is ready into the queue; end those whose compile failed."""
        hooks = self.structured_output
        assert hooks is not None
        still: list[Request] = []
        for request in self.waiting_for_grammar:
            state = hooks.poll(request)
            if state is False:
                still.append(request)
            elif state is True:
                request.status = RequestStatus.WAITING
                self.waiting.add(request, self._keys[request.request_id])
            else:
                self._end_outside_queues(request, str(state))
        self.waiting_for_grammar = still

    def _grammar_allows_drafts(self, request: Request) -> bool:
        return self.structured_output is not None and self.structured_output.allows_drafts(request)

    def _schedule_new(self, request: Request, num_new: int, structured_ids: list[str]) -> NewRequestData:
        """First scheduled, or resumed after preemption: everything the runner needs, once."""
        new = NewRequestData(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            request.eos_token_ids,
            [list(table) for table in self.kv.get_block_ids(request.request_id)],
            request.num_computed_tokens,  # before the step
            list(request.output_token_ids),
            request.lora_request,
        )
        # As vLLM v1, progress is counted at schedule time; a chunk that reaches the last token
        # samples, and the id comes with the step's results.
        if request.num_computed_tokens + num_new >= request.num_tokens + request.num_output_placeholders:
            request.num_output_placeholders += 1
            if request.use_structured_output:
                structured_ids.append(request.request_id)
        request.num_computed_tokens += num_new
        return new

    def _preempt_until_allocated(
        self, request: Request, num_new: int, num_drafts: int, lookahead: int, preempted: set[str]
    ) -> GroupBlockIds | None:
        """Preempt from the tail of `running` until the request's blocks fit; the new block ids.

        None when the request itself was preempted, or ended because it alone overflows the pool.
        """
        running = self.running
        while True:
            if len(running) == 1:  # nothing left to preempt: it can never get the blocks
                running.pop()
                self._end_outside_queues(
                    request, self._too_big_message(request, request.num_computed_tokens, num_new)
                )
                return None
            victim = running.pop()
            self._preempt(victim)
            preempted.add(victim.request_id)
            if victim is request:
                return None
            new_block_ids = self.kv.allocate_slots(request, num_new - num_drafts, None, lookahead)
            if new_block_ids is not None:
                return new_block_ids

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # proposals for a position it will reach again by recompute
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add_preempted(request, self._keys[request.request_id])

    def _too_big_message(self, request: Request, num_computed: int, num_new: int) -> str:
        kv = self.kv
        num_tokens = num_computed + num_new
        return (
            f"request needs {kv.num_blocks_needed(num_computed, num_new)} KV blocks for {num_tokens} tokens "
            f"but the whole pool has {kv.num_usable_blocks} blocks of {kv.block_size} tokens; raise "
            "num_kv_blocks or lower max_model_len / max_tokens"
        )

    def _end_outside_queues(
        self,
        request: Request,
        error: str,
        status: RequestStatus = RequestStatus.FINISHED_ERROR,
        retry_after: float | None = None,
    ) -> None:
        """End a request that is in no queue (refused by add_request, or taken out during
        schedule()); update_from_output reports it."""
        self._finish(request, status, error)
        output = self._final_output(request)
        output.retry_after = retry_after
        self._pending_outputs.append(output)

    # -- results ----------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, end errored requests; one output per
        request that got a token, prompt logprobs, or finished."""
        outputs, self._pending_outputs = self._pending_outputs, []
        self._unlaunched.difference_update(scheduler_output.num_scheduled_tokens)
        for request_id, message in runner_output.errored.items():
            # The step's KV for it may be garbage: keep it out of the prefix cache.
            outputs.extend(
                self._end_requests([request_id], RequestStatus.FINISHED_ERROR, message, uncache=True)
            )

        prompt_logprobs = self._new_prompt_logprobs(scheduler_output, runner_output)
        # Only a step that scheduled constrained requests can have grammar verdicts to ask for.
        constrained = scheduler_output.structured_output_request_ids
        verdicts = self._accept_single_tokens(runner_output) if constrained else {}
        logprobs = runner_output.logprobs
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        any_finished = False
        finished_waiting: set[str] = set()
        for index, (request_id, token_ids) in enumerate(
            zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True)
        ):
            request = self.requests.get(request_id)
            if request is None:
                continue  # ended since it was scheduled
            # A request preempted after this step was launched (async scheduling) still gets the
            # token: the step ran on its KV before any reuse of its blocks (same device stream),
            # and the recompute covers it.
            request.num_output_placeholders = max(request.num_output_placeholders - 1, 0)
            drafts = spec_tokens.get(request_id) if spec_tokens else None
            if drafts and token_ids and request.status == RequestStatus.RUNNING:
                # k drafts were computed; the runner returns the a accepted ones plus one more.
                # The KV of the k - a rejected ones is garbage: compute those positions again.
                num_rejected = len(drafts) + 1 - len(token_ids)
                if num_rejected > 0:
                    request.num_computed_tokens -= num_rejected
                if self.spec_stats is not None:
                    self.spec_stats.observe(len(drafts), len(token_ids) - 1)
            if len(token_ids) == 1:  # the common case: one token
                request.append_output_token_ids(token_ids)
                status = self._check_stop(request, token_ids[0], verdicts.get(request_id, _NOT_ACCEPTED))
                new_token_ids = token_ids
            else:
                new_token_ids, status = self._append_run(request, token_ids)
                if not new_token_ids:
                    continue
            token_logprobs = logprobs[index] if logprobs is not None else None
            output = EngineCoreOutput(
                request_id,
                new_token_ids=new_token_ids,
                new_logprobs=token_logprobs[: len(new_token_ids)] if token_logprobs is not None else None,
                new_prompt_logprobs=prompt_logprobs.pop(request_id, None),
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            if status is None:
                # Drafts follow the tokens just appended: only this step's proposal is current.
                proposal = runner_output.spec_token_ids.get(request_id) if runner_output.spec_token_ids else None
                request.spec_token_ids = proposal if proposal and request.status == RequestStatus.RUNNING else []
            else:
                if request.status == RequestStatus.RUNNING:
                    any_finished = True
                else:
                    finished_waiting.add(request_id)
                self._finish(request, status)
                output.finish_reason = status.finish_reason
                output.stop_reason = request.stop_reason
                output.error = request.error
            outputs.append(output)
        for request_id, entries in prompt_logprobs.items():  # prefill chunks that sampled nothing
            request = self.requests.get(request_id)
            if request is not None:
                outputs.append(
                    EngineCoreOutput(
                        request_id,
                        new_prompt_logprobs=entries,
                        num_cached_tokens=max(request.num_cached_tokens, 0),
                    )
                )
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        if finished_waiting:
            self.waiting.remove(finished_waiting)
        self.waiting.step_finished(scheduler_output, runner_output)
        if self.step_cost is not None:
            self._observe_step()
        return outputs

    def _observe_step(self) -> None:
        """The step whose results just came back, into the prefill step-time model."""
        seconds = self._step_timer.finished()
        if not self._step_mix:
            return
        num_prefill, num_decode = self._step_mix.popleft()
        if seconds is not None and num_prefill + num_decode:
            self.step_cost.observe(num_prefill, num_decode, seconds)  # type: ignore[union-attr]

    def _append_run(self, request: Request, token_ids: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens in order, checking stop conditions after each: a stop (EOS, stop token,
        max_tokens, max_model_len) cuts the run right there. Returns the appended tokens."""
        for count, token_id in enumerate(token_ids, start=1):
            request.append_output_token_ids([token_id])
            status = self._check_stop(request, token_id)
            if status is not None:
                return token_ids[:count], status
        return list(token_ids), None

    def _accept_single_tokens(self, runner_output: ModelRunnerOutput) -> dict[str, str | None]:
        """The grammars' verdicts on the step's one-token results, in one hook call before the
        update's loop (the step's mask can fill meanwhile); `_check_stop` uses them instead of
        accepting again."""
        hooks = self.structured_output
        if hooks is None:
            return {}
        batch = []
        for request_id, token_ids in zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True):
            if len(token_ids) == 1:
                request = self.requests.get(request_id)
                if request is not None and request.use_structured_output:
                    batch.append((request, token_ids[0]))
        if not batch:
            return {}
        results = hooks.accept_tokens(batch)
        return {request.request_id: error for (request, _), error in zip(batch, results, strict=True)}

    def _check_stop(
        self, request: Request, token_id: int, verdict: str | None | object = _NOT_ACCEPTED
    ) -> RequestStatus | None:
        """`verdict`: the grammar's answer to this token when `_accept_single_tokens` already asked."""
        if request.use_structured_output and self.structured_output is not None:
            if verdict is _NOT_ACCEPTED:
                error = self.structured_output.accept_token(request, token_id)
            else:
                error = verdict  # type: ignore[assignment]
            if error is not None:
                request.error = error
                return RequestStatus.FINISHED_ERROR
            if self.structured_output.is_terminated(request):
                return RequestStatus.FINISHED_STOPPED
        params = request.sampling_params
        num_output = len(request.output_token_ids)  # (not the properties: every request, every step)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.max_tokens is not None and num_output >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _new_prompt_logprobs(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[str, list[TokenLogprobs | None]]:
        """The runner's prompt logprobs minus positions already sent (a preempted request
        recomputes its prompt and would send them again)."""
        if not runner_output.prompt_logprobs:
            return {}
        chunk_starts = scheduler_output.num_computed_tokens_by_request()
        new: dict[str, list[TokenLogprobs | None]] = {}
        for request_id, entries in runner_output.prompt_logprobs.items():
            if request_id not in self.requests or request_id not in chunk_starts:
                continue
            # A chunk starting at s scores prompt tokens s+1.. (the first chunk also emits None for token 0).
            start = chunk_starts[request_id]
            first = 0 if start == 0 else start + 1
            sent = self._prompt_logprobs_sent.get(request_id, 0)
            self._prompt_logprobs_sent[request_id] = max(sent, first + len(entries))
            if first + len(entries) > sent:
                new[request_id] = entries[max(sent - first, 0) :]
        return new

    # -- ending requests --------------------------------------------------------------------

    def _end_requests(
        self, request_ids: Iterable[str], status: RequestStatus, error: str | None, *, uncache: bool = False
    ) -> list[EngineCoreOutput]:
        requests = {rid: self.requests[rid] for rid in request_ids if rid in self.requests}
        if not requests:
            return []
        running_ids = {rid for rid, r in requests.items() if r.status == RequestStatus.RUNNING}
        if running_ids:
            self.running = [r for r in self.running if r.request_id not in running_ids]
        compiling_ids = {rid for rid, r in requests.items() if r.status == RequestStatus.WAITING_FOR_GRAMMAR}
        if compiling_ids:
            self.waiting_for_grammar = [
                r for r in self.waiting_for_grammar if r.request_id not in compiling_ids
            ]
        if len(running_ids) + len(compiling_ids) < len(requests):
            self.waiting.remove(set(requests) - running_ids - compiling_ids)
        outputs = []
        for request in requests.values():
            # A step that was scheduled but not launched may never write this request's KV.
            self._finish(request, status, error, uncache=uncache or request.request_id in self._unlaunched)
            outputs.append(self._final_output(request))
        return outputs

    def _finish(
        self, request: Request, status: RequestStatus, error: str | None = None, *, uncache: bool = False
    ) -> None:
        """Mark a request ended and release everything it holds (the caller removes it from the queues)."""
        request.status = status
        if error is not None:
            request.error = error
        connector = self.kv_connector
        if connector is not None:
            has_blocks = self.kv.has_blocks(request.request_id)
            connector.request_finished(request, self.kv.get_block_ids(request.request_id)[0] if has_blocks else [])
        self.kv.free(request, uncache=uncache)
        request_id = request.request_id
        del self.requests[request_id]
        del self._keys[request_id]
        self._prompt_logprobs_sent.pop(request_id, None)
        self._finished_req_ids.add(request_id)
        if request.use_structured_output and self.structured_output is not None:
            self.structured_output.free(request_id)
        self.waiting.request_finished(request)

    def _final_output(self, request: Request) -> EngineCoreOutput:
        return EngineCoreOutput(
            request.request_id,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=request.error,
        )

    # -- checks for tests -------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the queues, the requests and the KV blocks disagree."""
        running_ids = [r.request_id for r in self.running]
        waiting_ids = [r.request_id for r in self.waiting]
        compiling_ids = [r.request_id for r in self.waiting_for_grammar]
        assert len(set(running_ids)) == len(running_ids), f"a request is in `running` twice: {running_ids}"
        assert not set(running_ids) & set(waiting_ids), "a request is both running and waiting"
        assert not set(compiling_ids) & (set(running_ids) | set(waiting_ids)), (
            "a request waiting for its grammar is also running or waiting"
        )
        assert len(running_ids) + len(waiting_ids) + len(compiling_ids) == len(self.requests), (
            f"{len(self.requests)} live requests but {len(running_ids)} running + {len(waiting_ids)} "
            f"waiting + {len(compiling_ids)} waiting for a grammar"
        )
        for request in self.waiting_for_grammar:
            assert request.status == RequestStatus.WAITING_FOR_GRAMMAR, f"{request!r} waits for a grammar"
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, f"{request!r} is in `running`"
            # One per step in flight: at most two with async scheduling.
            assert 0 <= request.num_output_placeholders <= 2, (
                f"{request!r} has {request.num_output_placeholders} tokens in flight"
            )
            assert self.requests.get(request.request_id) is request, f"{request!r} is running but not live"
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
                f"{request!r} is waiting"
            )
            assert self.requests.get(request.request_id) is request, f"{request!r} is waiting but not live"
        assert self.kv.request_ids_with_blocks() == set(running_ids), (
            "KV blocks are held by exactly the running requests: "
            f"holders {sorted(self.kv.request_ids_with_blocks())}, running {sorted(running_ids)}"
        )
        self.kv.check_invariants()
        if self.kv_connector is not None:
            self.kv_connector.check_invariants()


# Each scheduling policy's waiting queue, built from the scheduler's config.
_WAITING_QUEUES = {
    "fcfs": lambda config: FcfsQueue(),
    "priority": lambda config: PriorityQueue(),
    "slo": SloQueue,
}
