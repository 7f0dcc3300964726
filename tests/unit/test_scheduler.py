"""Scheduler with a fake model runner: budgets, chunked prefill, preemption, policies, abort, stops.

The fake runner checks what a real one relies on: each step it writes a fingerprint of every
computed position into the slots the block tables name, then checks that every request's whole
context reads back its own tokens (so prefix hits and block sharing are really right). Its
"model" picks the next token from the sequence so far only, like greedy decoding, so a request
must produce the same tokens whatever else is batched with it and however often it is preempted.

With `async_mode` the harness drives the scheduler as the async engine does: step N+1 is
scheduled and run before step N's results are applied, and the fake runner feeds a request the
token it sampled in the previous step (as the real one does on the device).
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.kv_cache_groups import KVCacheGroups
from tokenmill.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

VOCAB = 97


def next_token(tokens: list[int]) -> int:
    return (tokens[-1] * 31 + len(tokens) * 7 + 3) % VOCAB


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    while True:
        tokens.append(next_token(tokens))
        if len(tokens) - len(prompt) >= max_tokens or len(tokens) >= max_model_len:
            return tokens[len(prompt) :]


class Scheduled(NamedTuple):
    """One request's share of a step, read from a SchedulerOutput (new data or a diff)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    is_new: bool  # the step carries its full data: the runner holds no state for it


def scheduled(so: SchedulerOutput) -> list[Scheduled]:
    """The step's requests in batch order: the cached ones, then the new ones."""
    cached = so.scheduled_cached_reqs
    rows = [
        Scheduled(rid, start, so.num_scheduled_tokens[rid], False)
        for rid, start in zip(cached.request_ids, cached.num_computed_tokens, strict=True)
    ]
    rows += [
        Scheduled(new.request_id, new.num_computed_tokens, so.num_scheduled_tokens[new.request_id], True)
        for new in so.scheduled_new_reqs
    ]
    assert [r.request_id for r in rows] == list(so.num_scheduled_tokens), "batch order"
    return rows


class FakeState:
    """What the fake runner keeps per request, like the real one: it never reads core.Request."""

    def __init__(self, prompt: list[int], output: list[int], block_ids: list[list[int]]) -> None:
        self.num_prompt_tokens = len(prompt)
        self.tokens = [*prompt, *output]  # known on the "host"
        self.num_tokens = len(self.tokens)  # plus those sampled but not delivered yet
        self.block_ids = [list(table) for table in block_ids]  # per KV cache group
        self.num_computed_tokens = 0


class FakeRunner:
    """Writes and reads every KV cache group's slots (the scheduler's `kv.windows`): a full group
    reads a request's whole context, a sliding one only the window of the step's first query, as
    the attention backends do (its older entries may name blocks that slid out and were reused)."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.kv.block_size
        self.windows = scheduler.kv.windows
        self.null_block = scheduler.kv.pool.null_block
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (position, token id) written there
        self.fail_next: set[str] = set()  # request ids to report as errored in the next step
        self.script: dict[str, list[int]] = {}  # request id -> tokens to sample instead of next_token
        self.states: dict[str, FakeState] = {}  # requests the runner holds state for
        # The previous step's tokens, not yet on the "host": they reach the states only during
        # the next step (as with async scheduling), the step itself feeds them "on the device".
        self.last_sampled: dict[str, list[int]] = {}

    def _apply(self, so: SchedulerOutput) -> dict[str, FakeState]:
        for request_id in so.finished_req_ids | so.preempted_req_ids:
            self.states.pop(request_id, None)
        cached = so.scheduled_cached_reqs
        assert set(cached.new_block_ids) <= set(cached.request_ids)
        for request_id, start in zip(cached.request_ids, cached.num_computed_tokens, strict=True):
            # is_new exactly when the runner holds no state for it (first time, or after preemption).
            assert request_id in self.states, (request_id, False)
            if request_id in cached.new_block_ids:
                new_block_ids = cached.new_block_ids[request_id]
                for table, new_ids in zip(self.states[request_id].block_ids, new_block_ids, strict=True):
                    table.extend(new_ids)
            self.states[request_id].num_computed_tokens = start
        for new in so.scheduled_new_reqs:
            assert new.request_id not in self.states, (new.request_id, True)
            state = FakeState(new.prompt_token_ids, new.output_token_ids, new.block_ids)
            state.num_computed_tokens = new.num_computed_tokens
            self.states[new.request_id] = state
        return {rid: self.states[rid] for rid in so.num_scheduled_tokens}

    def _next(self, request_id: str, state: FakeState, context: list[int]) -> int:
        script = self.script.get(request_id)
        return script[len(context) - state.num_prompt_tokens] if script else next_token(context)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        config = self.scheduler.config
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= config.max_num_seqs
        scheduled(so)  # checks the batch order
        states = self._apply(so)
        contexts: dict[str, list[int]] = {}
        for request_id, state in states.items():
            num_new = so.num_scheduled_tokens[request_id]
            start = state.num_computed_tokens
            end = start + num_new
            tokens = list(state.tokens)
            in_flight = self.last_sampled.get(request_id)
            if in_flight:  # async: the token still in flight, fed from the last step
                tokens += in_flight
            drafts = so.scheduled_spec_decode_tokens.get(request_id, [])
            if drafts:  # they follow the last token, which the scheduler already has (no async)
                assert end == len(tokens) + len(drafts), (request_id, end, len(tokens))
                tokens += drafts
            elif end > len(state.tokens):
                assert num_new == 1 and end == len(tokens), (request_id, end, len(tokens))
            contexts[request_id] = tokens
            assert num_new > 0 and end <= config.max_model_len
            for table in state.block_ids:
                assert len(table) * self.block_size >= end
                for pos in range(start, end):
                    slot = self._slot(table, pos)
                    assert self.null_block is None or slot // self.block_size != self.null_block.block_id, (
                        f"{request_id} writes position {pos} into the null block"
                    )
                    self.slots[slot] = (pos, tokens[pos])
        for request_id, tokens in self.last_sampled.items():  # they reach the host now
            if request_id in self.states:
                self.states[request_id].tokens += tokens
        output = ModelRunnerOutput()
        self.last_sampled = {}
        for request_id, state in states.items():  # every layer stores the whole batch's K/V first
            tokens = contexts[request_id]
            start = state.num_computed_tokens
            end = start + so.num_scheduled_tokens[request_id]
            for table, window in zip(state.block_ids, self.windows, strict=True):
                first = 0 if window is None else max(0, start - window + 1)
                for pos in range(first, end):
                    assert self.slots.get(self._slot(table, pos)) == (pos, tokens[pos]), (
                        f"{request_id} reads wrong KV at position {pos} (window {window})"
                    )
            samples = end >= state.num_tokens
            if request_id in self.fail_next:
                output.errored[request_id] = "non-finite logits"
                if samples:  # a real runner still has a (garbage) row for it on the device
                    self.last_sampled[request_id] = [0]
                    state.num_tokens += 1
            elif samples:
                # Greedy verification of the drafts: keep them while they are what the model
                # would pick, then one more token of the model's own.
                drafts = so.scheduled_spec_decode_tokens.get(request_id, [])
                context = tokens[: len(tokens) - len(drafts)]
                sampled: list[int] = []
                for draft in drafts:
                    if draft != self._next(request_id, state, context):
                        break
                    sampled.append(draft)
                    context = [*context, draft]
                sampled.append(self._next(request_id, state, context))
                output.req_ids.append(request_id)
                output.sampled_token_ids.append(sampled)
                self.last_sampled[request_id] = sampled
                state.num_tokens += len(sampled)
        self.fail_next.clear()
        return output

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size


class Harness:
    def __init__(
        self,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 256,
        policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        async_mode: bool = False,
        kv_cache_groups: KVCacheGroups | None = None,
        max_prefill_tokens_while_decoding: int = 0,
        prefill_step_target_ms: float = 0.0,
    ) -> None:
        self.async_mode = async_mode
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs,
                max_num_batched_tokens,
                policy,  # type: ignore[arg-type]
                max_model_len,
                max_prefill_tokens_while_decoding=max_prefill_tokens_while_decoding,
                prefill_step_target_ms=prefill_step_target_ms,
            ),
            CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
            num_blocks,
            kv_cache_groups=kv_cache_groups,
        )
        self.runner = FakeRunner(self.scheduler)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finals: dict[str, EngineCoreOutput] = {}
        self.outputs: list[EngineCoreOutput] = []
        self.steps: list[SchedulerOutput] = []
        self.added: dict[str, Request] = {}

    def add(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        self.added[request.request_id] = request
        return request

    def record(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        for out in outputs:
            assert out.request_id not in self.finals, f"{out.request_id} got output after it ended"
            self.tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                self.finals[out.request_id] = out
        self.outputs.extend(outputs)
        return outputs

    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        self.steps.append(so)
        runner_output = self.runner.execute(so)
        if self.async_mode:  # apply the previous step's results only now, as the async engine does
            self.scheduler.launched(so)
            outputs = self.flush()
            self.in_flight = (so, runner_output)
            if so.is_empty:  # nothing launched: the engine applies it at once
                outputs += self.flush()
        else:
            outputs = self.record(self.scheduler.update_from_output(so, runner_output))
        self.scheduler.check_invariants()
        return outputs

    def flush(self) -> list[EngineCoreOutput]:
        """Apply the results of the step in flight (async mode), if any."""
        if self.in_flight is None:
            return []
        so, runner_output = self.in_flight
        self.in_flight = None
        return self.record(self.scheduler.update_from_output(so, runner_output))

    def run(self, max_steps: int = 1000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and self.in_flight is None:
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps: {self.scheduler.requests}")

    def abort(self, *request_ids: str) -> list[EngineCoreOutput]:
        outputs = self.record(self.scheduler.abort_requests(list(request_ids)))
        self.scheduler.check_invariants()
        return outputs


def make_request(
    request_id: str,
    prompt: int | list[int],
    max_tokens: int | None = 4,
    *,
    eos: tuple[int, ...] = (),
    priority: int = 0,
    arrival_time: float | None = None,
    **params: object,
) -> Request:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    return Request(
        request_id,
        tokens,
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=eos,
        priority=priority,
        arrival_time=arrival_time,
    )


def scheduled_counts(so: SchedulerOutput) -> dict[str, int]:
    return dict(so.num_scheduled_tokens)


# -- the basic path --------------------------------------------------------------------------


def test_one_request_prefill_then_decode_to_max_tokens() -> None:
    h = Harness()
    request = h.add(make_request("a", 10, max_tokens=3))
    so = h.scheduler.schedule()
    [s] = scheduled(so)
    assert (s.num_computed_tokens, s.num_new_tokens, s.is_new) == (0, 10, True)
    assert request.num_computed_tokens == 10 and request.status == RequestStatus.RUNNING
    assert request.num_cached_tokens == 0
    [out] = h.record(h.scheduler.update_from_output(so, h.runner.execute(so)))
    assert out.new_token_ids == [next_token(list(range(1, 11)))] and not out.finished
    so = h.scheduler.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens, s.is_new) for s in scheduled(so)] == [(10, 1, False)]
    h.record(h.scheduler.update_from_output(so, h.runner.execute(so)))
    h.run()
    assert h.tokens["a"] == reference_output(list(range(1, 11)), 3, 256)
    assert h.finals["a"].finish_reason == "length" and request.status == RequestStatus.FINISHED_LENGTH
    assert h.scheduler.schedule().finished_req_ids == {"a"}
    assert h.scheduler.schedule().finished_req_ids == set()
    assert h.scheduler.kv.usage == 0


def test_chunked_prefill_under_a_small_budget() -> None:
    h = Harness(max_num_batched_tokens=8)
    h.add(make_request("long", 20, max_tokens=2))
    h.add(make_request("short", 3, max_tokens=2))
    for _ in range(2):
        assert h.step() == []  # partial chunks sample nothing
        assert scheduled_counts(h.steps[-1]) == {"long": 8}
    outputs = h.step()
    assert scheduled_counts(h.steps[-1]) == {"long": 4, "short": 3}  # running first, then waiting
    assert {o.request_id for o in outputs} == {"long", "short"}
    h.run()
    assert h.tokens["long"] == reference_output(list(range(1, 21)), 2, 256)
    assert h.tokens["short"] == reference_output([1, 2, 3], 2, 256)


@pytest.mark.parametrize("async_mode", [False, True])
def test_prefill_cap_while_decoding_bounds_each_steps_prompt_tokens(async_mode: bool) -> None:
    h = Harness(max_num_batched_tokens=32, max_prefill_tokens_while_decoding=6, async_mode=async_mode)
    h.add(make_request("first", 20, max_tokens=12))
    h.step()
    assert scheduled_counts(h.steps[-1]) == {"first": 20}  # nothing decodes yet: the whole budget
    prompts = {"first": list(range(1, 21)), "long": list(range(100, 115)), "short": list(range(200, 204))}
    h.add(make_request("long", prompts["long"], max_tokens=3))  # no prefix shared with "first"
    h.add(make_request("short", prompts["short"], max_tokens=3))
    while "long" not in h.tokens or "short" not in h.tokens:
        h.step()
        counts = scheduled_counts(h.steps[-1])
        prefill = sum(n for rid, n in counts.items() if rid != "first")
        assert prefill <= 6, counts  # "first" decodes in every one of these steps
    # 15 + 4 prompt tokens at <= 6 a step: 4 steps (the partial chunk first, then admission)
    chunks = [scheduled_counts(so) for so in h.steps[1:5]]
    assert [c.get("long", 0) for c in chunks[:3]] == [6, 6, 3]
    assert [c.get("short", 0) for c in chunks] == [0, 0, 3, 1]
    h.run()
    for rid, max_tokens in (("first", 12), ("long", 3), ("short", 3)):
        assert h.tokens[rid] == reference_output(prompts[rid], max_tokens, 256)
    assert h.scheduler.kv.usage == 0


def test_prefill_cap_leaves_preemption_recompute_and_lone_prefills_whole() -> None:
    # Alone (no decode running) a prompt gets the whole budget despite the cap; a preempted request's
    # recompute is a prefill chunk like any other; outputs stay those of an uncapped run.
    h = Harness(num_blocks=12, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=5)
    prompts = [list(range(100 * i + 1, 100 * i + 11)) for i in range(4)]  # no shared prefix
    for i, prompt in enumerate(prompts):
        h.add(make_request(f"r{i}", prompt, max_tokens=8))
    h.step()
    assert sum(scheduled_counts(h.steps[0]).values()) == 40
    h.run()
    assert h.scheduler.num_preemptions_total > 0
    for i, prompt in enumerate(prompts):
        assert h.tokens[f"r{i}"] == reference_output(prompt, 8, 256)
    assert h.scheduler.kv.usage == 0


def test_max_num_seqs_caps_the_batch() -> None:
    h = Harness(max_num_seqs=2)
    for i in range(5):
        h.add(make_request(f"r{i}", 5 + i, max_tokens=3))
    h.run()
    assert max(len(scheduled(so)) for so in h.steps) == 2
    for i in range(5):
        assert h.tokens[f"r{i}"] == reference_output(list(range(1, 6 + i)), 3, 256)


def test_prefix_hit_sets_num_cached_tokens_and_skips_computation() -> None:
    h = Harness(block_size=4)
    prompt = list(range(1, 15))
    h.add(make_request("first", prompt, max_tokens=2))
    h.add(make_request("sibling", prompt, max_tokens=2))  # same step: hits blocks cached at allocation
    h.step()
    assert scheduled_counts(h.steps[-1]) == {"first": 14, "sibling": 2}
    h.run()
    later = h.add(make_request("later", [*prompt, 50], max_tokens=2))
    h.step()
    assert later.num_cached_tokens == 12 and scheduled_counts(h.steps[-1]) == {"later": 3}
    h.run()
    assert h.finals["later"].num_cached_tokens == 12 and h.finals["first"].num_cached_tokens == 0
    assert h.tokens["later"] == reference_output([*prompt, 50], 2, 256)
    assert h.tokens["sibling"] == h.tokens["first"]
    stats = h.scheduler.get_stats()
    assert stats["prefix_cache_hits"] == 24 and stats["prefix_cache_queries"] == 14 + 14 + 15


# -- preemption ------------------------------------------------------------------------------


def test_preemption_when_blocks_run_out_keeps_outputs_identical() -> None:
    prompts = {f"r{i}": list(range(10 * i + 1, 10 * i + 8)) for i in range(4)}
    h = Harness(num_blocks=8, block_size=4, enable_prefix_caching=False)
    for request_id, prompt in prompts.items():
        h.add(make_request(request_id, prompt, max_tokens=12))
    h.run()
    assert h.scheduler.num_preemptions_total > 0
    preempted = set().union(*(so.preempted_req_ids for so in h.steps))
    assert preempted
    for request_id, prompt in prompts.items():
        assert h.tokens[request_id] == reference_output(prompt, 12, 256), request_id
        assert h.finals[request_id].finish_reason == "length"
    # A preempted request comes back as new, recomputing from token 0.
    resumed = [
        s for so in h.steps for s in scheduled(so) if h.added[s.request_id].num_preemptions and s.is_new
    ]
    assert any(s.num_computed_tokens == 0 for s in resumed)
    assert h.scheduler.get_stats()["num_preemptions_total"] == h.scheduler.num_preemptions_total


def test_fcfs_preempts_the_latest_running_request_and_requeues_it_first() -> None:
    h = Harness(num_blocks=6, block_size=4)
    early = h.add(make_request("early", 7, max_tokens=15))  # 22 tokens: the whole pool
    late = h.add(make_request("late", 7, max_tokens=15))
    waiting = h.add(make_request("waiting", 3, max_tokens=1))
    h.step()  # early, late each get 2 blocks; waiting needs 1 more: fits (6 blocks)
    while not late.num_preemptions:
        h.step()
    assert early.num_preemptions == 0 and late.status == RequestStatus.PREEMPTED
    assert list(h.scheduler.waiting)[0] is late
    assert waiting.is_finished
    h.run()
    assert h.tokens["late"] == reference_output(list(range(1, 8)), 15, 256)


def test_priority_policy_orders_admission_and_preempts_the_lowest_priority() -> None:
    h = Harness(num_blocks=6, block_size=4, max_num_seqs=1, policy="priority")
    h.add(make_request("low", 3, max_tokens=1, priority=5, arrival_time=1.0))
    h.add(make_request("high", 3, max_tokens=1, priority=0, arrival_time=2.0))
    h.add(make_request("high-later", 3, max_tokens=1, priority=0, arrival_time=3.0))
    h.run()
    order = [scheduled(so)[0].request_id for so in h.steps if not so.is_empty]
    assert order == ["high", "high-later", "low"]

    h = Harness(num_blocks=6, block_size=4, policy="priority")
    low = h.add(make_request("low", 7, max_tokens=15, priority=5, arrival_time=1.0))
    h.step()
    high = h.add(make_request("high", 7, max_tokens=15, priority=0, arrival_time=2.0))
    h.step()
    assert [r.request_id for r in h.scheduler.running] == ["high", "low"]
    while not (low.num_preemptions or high.num_preemptions):
        h.step()
    assert low.num_preemptions == 1 and high.num_preemptions == 0  # FCFS would have picked "high"
    h.run()
    assert h.tokens["low"] == reference_output(list(range(1, 8)), 15, 256)


def test_request_larger_than_the_pool_ends_with_an_error_instead_of_looping() -> None:
    h = Harness(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    h.add(make_request("prompt-too-big", 17, max_tokens=2))  # 5 blocks for the prompt alone
    so = h.scheduler.schedule()
    assert so.is_empty and h.scheduler.has_unfinished_requests()
    [out] = h.record(h.scheduler.update_from_output(so, ModelRunnerOutput()))
    assert out.finish_reason == "error" and "pool has 4 blocks" in (out.error or "")
    assert not h.scheduler.has_unfinished_requests()

    h.add(make_request("grows-too-big", 14, max_tokens=10))  # fits at first, then outgrows the pool
    h.add(make_request("small", 2, max_tokens=10))
    h.run()
    assert h.finals["grows-too-big"].finish_reason == "error"
    assert h.finals["small"].finish_reason == "length"
    # Positions 0..15 fit in 4 blocks (3 tokens sampled, the last from position 15); 16 does not.
    assert len(h.tokens["grows-too-big"]) == 3


def test_prompt_longer_than_max_model_len_is_refused_not_stuck() -> None:
    h = Harness(max_model_len=16)
    h.add(make_request("too-long", 17))
    h.add(make_request("fine", 16, max_tokens=5))
    h.run()
    assert h.finals["too-long"].finish_reason == "error" and "max_model_len" in (
        h.finals["too-long"].error or ""
    )
    assert h.finals["fine"].finish_reason == "length" and len(h.tokens["fine"]) == 1


# -- abort and errors ------------------------------------------------------------------------


def test_abort_waiting_running_midprefill_and_unknown() -> None:
    h = Harness(max_num_seqs=1, max_num_batched_tokens=4)
    h.add(make_request("running", 10))
    h.add(make_request("waiting", 3))
    h.step()
    assert h.scheduler.num_running == 1 and h.scheduler.num_waiting == 1
    outputs = h.abort("running", "waiting", "unknown", "running")
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [
        ("running", "abort"),
        ("waiting", "abort"),
    ]
    assert h.abort("running") == []
    assert not h.scheduler.has_unfinished_requests() and h.scheduler.kv.usage == 0
    assert h.scheduler.schedule().finished_req_ids == {"running", "waiting"}


def test_abort_between_schedule_and_update_is_skipped_and_not_cached() -> None:
    h = Harness()
    prompt = list(range(1, 14))
    h.add(make_request("a", prompt))
    h.add(make_request("b", 5))
    so = h.scheduler.schedule()
    runner_output = h.runner.execute(so)
    h.abort("a")
    outputs = h.record(h.scheduler.update_from_output(so, runner_output))
    assert [o.request_id for o in outputs] == ["b"]
    h.scheduler.check_invariants()
    h.add(make_request("again", prompt))
    h.step()
    assert h.scheduler.requests["again"].num_cached_tokens == 0  # its step may never have run


def test_runner_error_ends_only_that_request_and_drops_its_cache() -> None:
    h = Harness()
    prompt = list(range(1, 14))
    h.add(make_request("bad", prompt))
    h.add(make_request("good", 5, max_tokens=3))
    h.runner.fail_next.add("bad")
    h.step()
    assert h.finals["bad"].finish_reason == "error" and h.finals["bad"].error == "non-finite logits"
    h.add(make_request("retry", prompt, max_tokens=2))
    h.run()
    assert h.finals["retry"].num_cached_tokens == 0
    assert h.tokens["good"] == reference_output([1, 2, 3, 4, 5], 3, 256)


def test_finish_request_from_outside() -> None:
    h = Harness()
    request = h.add(make_request("a", 5, max_tokens=10))
    h.step()
    [out] = h.record(h.scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED))
    assert out.finish_reason == "stop" and request.status == RequestStatus.FINISHED_STOPPED
    assert h.scheduler.finish_request("a", RequestStatus.FINISHED_STOPPED) == []
    with pytest.raises(ValueError, match="finished status"):
        h.scheduler.finish_request("a", RequestStatus.RUNNING)
    h.scheduler.check_invariants()


def test_duplicate_request_id_is_refused() -> None:
    h = Harness()
    h.add(make_request("a", 5))
    with pytest.raises(ValueError, match="already in use"):
        h.add(make_request("a", 5))


# -- stop conditions -------------------------------------------------------------------------


def run_scripted(script: list[int], max_tokens: int | None = 10, max_model_len: int = 256, **kwargs: object):
    h = Harness(max_model_len=max_model_len)
    eos = kwargs.pop("eos", (2,))
    h.add(make_request("a", 4, max_tokens=max_tokens, eos=eos, **kwargs))  # type: ignore[arg-type]
    h.runner.script["a"] = script
    h.run()
    return h.tokens["a"], h.finals["a"]


def test_stop_on_eos() -> None:
    tokens, final = run_scripted([5, 6, 2, 7, 8])
    assert tokens == [5, 6, 2] and final.finish_reason == "stop" and final.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    tokens, final = run_scripted([5, 2, 2, 7, 8], max_tokens=5, ignore_eos=True)
    assert tokens == [5, 2, 2, 7, 8] and final.finish_reason == "length"


def test_stop_token_ids_set_stop_reason() -> None:
    tokens, final = run_scripted([5, 9, 6], stop_token_ids=[9])
    assert tokens == [5, 9] and final.finish_reason == "stop" and final.stop_reason == 9


def test_min_tokens_delays_eos_and_stop_tokens() -> None:
    tokens, final = run_scripted([2, 9, 5, 2, 6], min_tokens=3, stop_token_ids=[9])
    assert tokens == [2, 9, 5, 2] and final.finish_reason == "stop"
    tokens, _ = run_scripted([2, 9, 2, 6], min_tokens=3, stop_token_ids=[9])
    assert tokens == [2, 9, 2]  # the third token counts: num_output_tokens reached min_tokens


def test_max_tokens_and_max_model_len() -> None:
    tokens, final = run_scripted([5, 6, 7, 8], max_tokens=3)
    assert tokens == [5, 6, 7] and final.finish_reason == "length"
    tokens, final = run_scripted([5, 6, 7, 8, 9], max_tokens=None, max_model_len=7)
    assert tokens == [5, 6, 7] and final.finish_reason == "length"


def test_logprobs_are_passed_through() -> None:
    h = Harness()
    h.add(make_request("a", 3, max_tokens=1))
    so = h.scheduler.schedule()
    lp = TokenLogprobs(token_ids=[7], logprobs=[-0.5], rank=1)
    [out] = h.scheduler.update_from_output(
        so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]], logprobs=[[lp]])
    )
    assert out.new_logprobs == [lp] and out.new_token_ids == [7] and out.finish_reason == "length"


def test_prompt_logprobs_are_not_sent_twice_after_preemption() -> None:
    h = Harness(num_blocks=5, block_size=4, max_num_batched_tokens=5, enable_prefix_caching=False)
    h.add(make_request("other", 6, max_tokens=6))  # earlier, so "wants" is the one preempted
    wants = h.add(make_request("wants", 12, max_tokens=6, prompt_logprobs=0))
    received: list[int | None] = []
    for _ in range(200):
        if not h.scheduler.has_unfinished_requests():
            break
        so = h.scheduler.schedule()
        runner_output = h.runner.execute(so)
        for s in scheduled(so):  # the real runner's convention: a chunk at s scores tokens s+1..
            if s.request_id == "wants" and s.num_computed_tokens < wants.num_prompt_tokens:
                start = s.num_computed_tokens
                last = min(start + s.num_new_tokens, wants.num_prompt_tokens - 1)
                entries: list[TokenLogprobs | None] = [None] if start == 0 else []
                entries += [TokenLogprobs([i], [0.0], 1) for i in range(start + 1, last + 1)]
                runner_output.prompt_logprobs["wants"] = entries
        for out in h.record(h.scheduler.update_from_output(so, runner_output)):
            if out.request_id == "wants" and out.new_prompt_logprobs is not None:
                received += [e.token_ids[0] if e else None for e in out.new_prompt_logprobs]
    assert wants.num_preemptions > 0
    assert received == [None, *range(1, 12)]


# -- draft tokens (speculative decoding) ------------------------------------------------------


def true_drafts(request: Request, k: int, script: list[int] | None = None) -> list[int]:
    """The next k tokens the fake model will pick: drafts a perfect proposer would make."""
    tokens = list(request.all_token_ids)
    drafts = []
    for _ in range(k):
        n_out = len(tokens) - request.num_prompt_tokens
        if script is not None and n_out >= len(script):
            break
        token = script[n_out] if script is not None else next_token(tokens)
        tokens.append(token)
        drafts.append(token)
    return drafts


def wrong(tokens: list[int]) -> list[int]:
    return [(t + 1) % VOCAB for t in tokens]


def run_with_drafts(h: Harness, propose, max_steps: int = 500) -> None:
    """Run to completion, giving every decoding request the proposer's drafts before each step."""
    for _ in range(max_steps):
        if not h.scheduler.has_unfinished_requests():
            return
        for request in h.scheduler.running:
            if request.num_computed_tokens == request.num_tokens - 1:  # decoding
                request.spec_token_ids = propose(request)
        h.step()
    raise AssertionError("requests still unfinished")


def test_drafts_all_accepted_advance_several_tokens_a_step() -> None:
    h = Harness()
    prompt = list(range(1, 11))
    request = h.add(make_request("a", prompt, max_tokens=13))
    run_with_drafts(h, lambda r: true_drafts(r, 3))
    assert h.tokens["a"] == reference_output(prompt, 13, 256)
    assert h.finals["a"].finish_reason == "length"
    # Prefill (1 token), then 4 tokens a step: 1 + 4 + 4 + 4 = 13, the last run cut by max_tokens.
    assert [len(out.new_token_ids) for out in h.outputs] == [1, 4, 4, 4]
    drafted = [so for so in h.steps if so.scheduled_spec_decode_tokens]
    assert drafted and all(so.num_scheduled_tokens["a"] == 4 for so in drafted)
    assert request.num_computed_tokens == request.num_tokens - 1 or request.is_finished


@pytest.mark.parametrize("num_right", [0, 1, 2])
def test_rejected_drafts_roll_num_computed_tokens_back(num_right: int) -> None:
    h = Harness()
    prompt = list(range(1, 8))
    request = h.add(make_request("a", prompt, max_tokens=10))
    h.step()  # prefill
    while not request.is_finished:
        # Three drafts, of which the first num_right are what the model picks.
        true = true_drafts(request, 3)
        drafts = true[:num_right] + wrong(true[num_right:])
        request.spec_token_ids = list(drafts)
        num_tokens_before = request.num_tokens
        # Drafts past max_tokens are not scheduled (the run would be cut there anyway).
        scheduled = drafts[: max(request.max_tokens - request.num_output_tokens - 1, 0)]
        outputs = h.step()
        assert h.steps[-1].scheduled_spec_decode_tokens == ({"a": scheduled} if scheduled else {})
        assert h.steps[-1].num_scheduled_tokens == {"a": 1 + len(scheduled)}
        if not request.is_finished:
            # a accepted + 1 more appended; the k - a rejected positions are computed again.
            num_kept = min(num_right, len(scheduled))
            assert [len(o.new_token_ids) for o in outputs] == [num_kept + 1]
            assert request.num_tokens == num_tokens_before + num_kept + 1
            assert request.num_computed_tokens == request.num_tokens - 1
    assert h.tokens["a"] == reference_output(prompt, 10, 256)


@pytest.mark.parametrize(
    ("script", "kwargs", "expected", "reason"),
    [
        ([5, 6, 2, 7, 8, 9], {}, [5, 6, 2], "stop"),  # EOS in the middle of an accepted run
        ([5, 6, 9, 7, 8, 3], {"stop_token_ids": [9]}, [5, 6, 9], "stop"),
        ([5, 6, 7, 8, 9, 3], {"max_tokens": 3}, [5, 6, 7], "length"),
        ([5, 2, 2, 7, 8, 3], {"min_tokens": 3}, [5, 2, 2], "stop"),  # the first EOS is too early
    ],
)
def test_a_stop_inside_an_accepted_run_cuts_it_there(script, kwargs, expected, reason) -> None:
    h = Harness()
    request = h.add(make_request("a", 4, eos=(2,), **{"max_tokens": 10, **kwargs}))  # type: ignore[arg-type]
    h.runner.script["a"] = script
    h.step()  # prefill: samples script[0]
    request.spec_token_ids = true_drafts(request, 4, script)
    assert request.spec_token_ids == script[1:5]
    h.step()  # all four drafts accepted, plus one more: the stop comes inside the run
    assert request.is_finished
    assert h.tokens["a"] == expected and h.finals["a"].finish_reason == reason
    h.scheduler.check_invariants()
    assert h.scheduler.kv.usage == 0


def test_drafts_are_cut_by_the_token_budget() -> None:
    h = Harness(max_num_batched_tokens=3)
    prompt = list(range(1, 9))
    request = h.add(make_request("a", prompt, max_tokens=20))
    for _ in range(3):  # the 8-token prompt in chunks of 3
        h.step()
    assert request.num_tokens == 9 and request.num_computed_tokens == 8
    request.spec_token_ids = true_drafts(request, 5)
    h.step()
    # The budget (3 tokens) leaves room for 2 drafts after the last known token.
    assert h.steps[-1].scheduled_spec_decode_tokens == {"a": reference_output(prompt, 3, 256)[1:]}
    assert h.steps[-1].num_scheduled_tokens == {"a": 3}
    assert request.spec_token_ids == []  # the unscheduled ones were stale after this step
    h.run()
    assert h.tokens["a"] == reference_output(prompt, 20, 256)


def test_drafts_are_cut_at_max_model_len() -> None:
    h = Harness(max_model_len=12)
    prompt = list(range(1, 10))
    request = h.add(make_request("a", prompt, max_tokens=None))
    h.step()  # prefill: 10 tokens, 9 computed
    request.spec_token_ids = true_drafts(request, 5)
    h.step()
    # Positions 9..11 fit in max_model_len: 1 known token + 2 drafts; the request ends at 12
    # tokens, inside the run (2 drafts accepted + 1 more, of which the last is cut).
    assert h.steps[-1].scheduled_spec_decode_tokens == {"a": reference_output(prompt, 3, 256)[1:]}
    assert h.finals["a"].finish_reason == "length"
    assert h.tokens["a"] == reference_output(prompt, 100, 12) and len(h.tokens["a"]) == 3


@pytest.mark.parametrize("accept", ["all", "some", "none"])
def test_preempting_requests_with_drafts_leaks_no_block(accept: str) -> None:
    prompts = {f"r{i}": list(range(10 * i + 1, 10 * i + 8)) for i in range(4)}
    h = Harness(num_blocks=9, block_size=4, enable_prefix_caching=False)
    for request_id, prompt in prompts.items():
        h.add(make_request(request_id, prompt, max_tokens=12))

    def propose(request: Request) -> list[int]:
        drafts = true_drafts(request, 3)
        if accept == "some":
            return drafts[:1] + wrong(drafts[1:])
        return drafts if accept == "all" else wrong(drafts)

    run_with_drafts(h, propose)
    assert h.scheduler.num_preemptions_total > 0
    assert any(so.scheduled_spec_decode_tokens for so in h.steps)
    for request_id, prompt in prompts.items():
        assert h.tokens[request_id] == reference_output(prompt, 12, 256), request_id
    h.scheduler.check_invariants()
    assert h.scheduler.kv.num_free_blocks == 9 and h.scheduler.kv.usage == 0


def test_lookahead_slots_are_reserved_but_never_cached() -> None:
    h = Harness(block_size=4)
    prompt = list(range(1, 8))  # 7 tokens
    request = h.add(make_request("a", prompt, max_tokens=10))
    h.step()  # prefill: 2 blocks, 8 tokens known
    request.spec_token_ids = wrong(true_drafts(request, 4))  # all rejected: positions 8..11
    h.step()
    # The step computed positions 7..11: 3 blocks, the third holding only drafts.
    assert len(h.scheduler.kv.get_block_ids("a")[0]) == 3
    assert request.num_computed_tokens == 8 and request.num_tokens == 9
    cached = [b for b in h.scheduler.kv.pool.blocks if b.block_hash is not None]
    assert len(cached) == 2  # the two full blocks of real tokens, never one with drafts
    h.run()
    assert h.tokens["a"] == reference_output(prompt, 10, 256)


# -- properties ------------------------------------------------------------------------------

scheduler_configs = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(1, 40),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "max_num_seqs": st.integers(1, 6),
        "max_num_batched_tokens": st.integers(1, 32),
        "max_model_len": st.integers(8, 96),
        "policy": st.sampled_from(["fcfs", "priority", "slo"]),
        "enable_prefix_caching": st.booleans(),
    }
)
# (prompt length, max_tokens, prefix group, priority): prompts of one group are prefixes of each other.
request_specs = st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 2), st.integers(0, 2))


def spec_request(request_id: str, spec: tuple[int, int, int, int], salt: str | None = None) -> Request:
    length, max_tokens, group, priority = spec
    prompt = [(group * 13 + k) % VOCAB for k in range(length)]
    return Request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens), priority=priority, cache_salt=salt
    )


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), request_specs, st.sampled_from([None, "salt"])),
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.sampled_from(["abort", "finish", "fail", "abort_in_flight"]), st.integers(0, 40)),
    ),
    max_size=60,
)


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=scheduler_configs, ops=operations, drain_steps=st.integers(0, 30))
def test_random_add_step_abort_finish_never_leaks(
    async_mode: bool, config: dict, ops: list[tuple], drain_steps: int
) -> None:
    h = Harness(**config, async_mode=async_mode)
    scheduler = h.scheduler
    added: list[str] = []
    for op in ops:
        live = list(scheduler.requests)
        target = live[op[1] % len(live)] if op[0] != "add" and op[0] != "step" and live else None
        if op[0] == "add":
            added.append(f"r{len(added)}")
            h.add(spec_request(added[-1], op[1], op[2]))
        elif op[0] == "step":
            h.step()
        elif target is None:
            continue
        elif op[0] == "abort":
            h.abort(target)
        elif op[0] == "finish":
            h.record(scheduler.finish_request(target, RequestStatus.FINISHED_STOPPED))
        elif op[0] == "fail":
            h.runner.fail_next.add(target)
            h.step()
        elif async_mode:  # a step is always in flight between steps: abort now
            h.abort(target)
        else:  # abort while its step is with the runner
            so = scheduler.schedule()
            runner_output = h.runner.execute(so)
            h.abort(target)
            h.record(scheduler.update_from_output(so, runner_output))
        scheduler.check_invariants()
    for _ in range(drain_steps):
        h.step()
    h.abort(*added)
    h.step()  # flush what schedule() ended on its own
    h.flush()
    scheduler.check_invariants()
    assert not scheduler.has_unfinished_requests() and scheduler.kv.usage == 0
    assert set(h.finals) == set(added), "every request ends exactly once"
    assert scheduler.kv.num_free_blocks == config["num_blocks"]


@pytest.mark.parametrize("async_mode", [False, True], ids=["sync", "async"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=scheduler_configs, specs=st.lists(request_specs, min_size=1, max_size=10))
def test_every_request_completes_with_batch_independent_tokens(
    async_mode: bool, config: dict, specs: list[tuple]
) -> None:
    h = Harness(**config, async_mode=async_mode)
    requests = [h.add(spec_request(f"r{i}", spec)) for i, spec in enumerate(specs)]
    h.run(max_steps=5000)
    max_model_len, block_size = config["max_model_len"], config["block_size"]
    for request in requests:
        final = h.finals[request.request_id]
        prompt_len, max_tokens = request.num_prompt_tokens, request.max_tokens
        assert max_tokens is not None
        final_len = min(prompt_len + max_tokens, max_model_len)
        positions_needed = max(final_len - 1, prompt_len)  # the last token is sampled, never computed
        fits = prompt_len <= max_model_len and -(-positions_needed // block_size) <= config["num_blocks"]
        if fits:
            assert final.finish_reason == "length", (request, final)
            assert h.tokens[request.request_id] == reference_output(
                request.prompt_token_ids, max_tokens, max_model_len
            )
        else:
            assert final.finish_reason == "error" and final.error
