"""The scheduler's structured-output hooks with a fake grammar backend (no model, no xgrammar):
a compiling request waits without holding up FCFS, a failed compile ends only its request, an
abort while compiling leaves nothing behind, each sampling step lists its constrained requests,
the grammar's verdict on each token ends or stops the request."""

from __future__ import annotations

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.structured_output import INVALID_PREFIX
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams


class FakeGrammars:
    """Compiles on demand (`ready` / `failed`); the grammar allows tokens < 50 and ends at 7."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.ready: set[str] = set()
        self.failed: dict[str, str] = {}
        self.accepted: dict[str, list[int]] = {}
        self.freed: list[str] = []
        self.batches: list[list[str]] = []

    def start(self, request: Request) -> None:
        self.started.append(request.request_id)

    def poll(self, request: Request) -> str | bool:
        rid = request.request_id
        if rid in self.failed:
            return self.failed[rid]
        return rid in self.ready

    def accept_token(self, request: Request, token_id: int) -> str | None:
        if token_id >= 50:
            return f"token {token_id} not allowed"
        self.accepted.setdefault(request.request_id, []).append(token_id)
        return None

    def accept_tokens(self, batch: list[tuple[Request, int]]) -> list[str | None]:
        self.batches.append([request.request_id for request, _ in batch])
        return [self.accept_token(request, token_id) for request, token_id in batch]

    def is_terminated(self, request: Request) -> bool:
        return self.accepted.get(request.request_id, [])[-1:] == [7]

    def free(self, request_id: str) -> None:
        self.freed.append(request_id)


def _scheduler(grammars: FakeGrammars, budget: int = 64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=256)
    return Scheduler(
        config, CacheConfig(block_size=4, enable_prefix_caching=False), 64, structured_output=grammars
    )


def _request(rid: str, constrained: bool, prompt_len: int = 6) -> Request:
    so = StructuredOutputsParams(regex="[0-9]+") if constrained else None
    params = SamplingParams(max_tokens=20, ignore_eos=True, structured_outputs=so)
    return Request(rid, list(range(1, prompt_len + 1)), params)


def _sample(so: SchedulerOutput, tokens: dict[str, int]) -> ModelRunnerOutput:
    """Every request whose chunk reaches its end samples tokens[rid] (default 1)."""
    rids = [rid for rid in so.num_scheduled_tokens]
    return ModelRunnerOutput(req_ids=rids, sampled_token_ids=[[tokens.get(r, 1)] for r in rids])


def test_compiling_request_waits_without_blocking_fcfs_then_runs_constrained():
    grammars = FakeGrammars()
    s = _scheduler(grammars)
    s.add_request(_request("c", True))
    s.add_request(_request("p", False))
    assert grammars.started == ["c"] and s.requests["c"].status == RequestStatus.WAITING_FOR_GRAMMAR
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["p"] and not so.structured_output_request_ids
    s.update_from_output(so, _sample(so, {}))
    s.check_invariants()
    assert s.get_stats()["num_waiting"] == 1

    grammars.ready.add("c")
    so = s.schedule()
    assert list(so.num_scheduled_tokens) == ["p", "c"]
    assert so.structured_output_request_ids == ["c"]
    outs = s.update_from_output(so, _sample(so, {"c": 3}))
    assert grammars.accepted == {"c": [3]} and all(not o.finished for o in outs)
    so = s.schedule()
    assert so.structured_output_request_ids == ["c"]
    outs = {o.request_id: o for o in s.update_from_output(so, _sample(so, {"c": 7}))}
    assert outs["c"].finish_reason == "stop" and "c" in grammars.freed  # the grammar completed
    so = s.schedule()
    outs = {o.request_id: o for o in s.update_from_output(so, _sample(so, {"p": 99}))}
    assert not outs["p"].finished  # unconstrained: any token
    s.check_invariants()


def test_chunked_prefill_lists_the_request_only_when_its_chunk_samples():
    grammars = FakeGrammars()
    grammars.ready.add("c")
    s = _scheduler(grammars, budget=4)
    s.add_request(_request("c", True, prompt_len=10))
    listed = []
    for _ in range(3):
        so = s.schedule()
        listed.append(so.structured_output_request_ids)
        s.update_from_output(so, _sample(so, {}) if so.structured_output_request_ids else ModelRunnerOutput())
    assert listed == [[], [], ["c"]]
    s.check_invariants()


def test_failed_compile_and_rejected_token_end_only_their_request():
    grammars = FakeGrammars()
    grammars.failed["bad"] = INVALID_PREFIX + "regex: nope"
    grammars.ready.add("c")
    s = _scheduler(grammars)
    for rid, constrained in (("bad", True), ("c", True), ("p", False)):
        s.add_request(_request(rid, constrained))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"c", "p"}
    outs = {o.request_id: o for o in s.update_from_output(so, _sample(so, {"c": 60}))}
    assert outs["bad"].finish_reason == "error" and outs["bad"].error == INVALID_PREFIX + "regex: nope"
    assert outs["c"].finish_reason == "error" and outs["c"].error == "token 60 not allowed"
    assert not outs["p"].finished
    assert set(grammars.freed) == {"bad", "c"}
    s.check_invariants()
    assert s.kv.request_ids_with_blocks() == {"p"}


def test_abort_while_compiling_leaves_nothing_behind():
    grammars = FakeGrammars()
    s = _scheduler(grammars)
    s.add_request(_request("c", True))
    outs = s.abort_requests(["c"])
    assert [o.finish_reason for o in outs] == ["abort"] and grammars.freed == ["c"]
    assert not s.waiting_for_grammar and not s.requests
    s.check_invariants()


def test_without_hooks_a_constrained_request_errors():
    s = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4), 16)
    s.add_request(_request("c", True))
    so = s.schedule()
    outs = s.update_from_output(so, ModelRunnerOutput())
    assert outs[0].finish_reason == "error" and "not available" in outs[0].error
    s.check_invariants()


def test_a_steps_one_token_results_are_accepted_in_one_batch_call():
    """Every constrained request's token of a step goes to the grammars in one `accept_tokens` call
    (unconstrained ones do not); the verdicts end, stop or keep each request as one by one would."""
    grammars = FakeGrammars()
    grammars.ready.update({"a", "b", "c"})
    s = _scheduler(grammars)
    for rid, constrained in (("a", True), ("p", False), ("b", True), ("c", True)):
        s.add_request(_request(rid, constrained))
    so = s.schedule()
    assert sorted(so.structured_output_request_ids) == ["a", "b", "c"]
    outs = {o.request_id: o for o in s.update_from_output(so, _sample(so, {"a": 3, "b": 60, "c": 7, "p": 99}))}
    assert [sorted(batch) for batch in grammars.batches] == [["a", "b", "c"]]
    assert grammars.accepted == {"a": [3], "c": [7]}  # each token accepted once
    assert not outs["a"].finished and not outs["p"].finished
    assert outs["b"].finish_reason == "error" and outs["b"].error == "token 60 not allowed"
    assert outs["c"].finish_reason == "stop"  # its grammar completed
    s.check_invariants()
