"""The `slo` policy keeps a step's prefill room for a waiting higher class's first token: a lower
class's half-prefilled prompt (a running request's next chunk, scheduled before any admission)
takes only what that token's whole prompt leaves, and nothing when the step would then end past
its deadline.

No model: test_scheduler's fake runner, the slo queue on a fake clock and a cost model trained on
known step costs (0.1 s + 0.01 s per token), as in test_slo_preemption; every number below is
computed in the comments. Budget 64 tokens a step, at most 32 of them prefill while anything
decodes (--max-prefill-tokens-while-decoding, the CPU server's rule).
"""

from __future__ import annotations

from tests.unit.test_scheduler import Harness, make_request, reference_output, scheduled_counts
from tests.unit.test_slo_preemption import CLASSES, prompt
from tests.unit.test_slo_scheduler import req, slo_harness
from tokenmill.config import SloConfig
from tokenmill.core.request import RequestStatus
from tokenmill.core.step_cost import StepCostModel
from tokenmill.slo import parse_slo_classes

PROMPTS = {"dec": prompt(4, 0), "low": prompt(64, 1), "high": prompt(24, 2)}


def start_a_half_prefilled_low_request(h: Harness) -> None:
    """'dec' decodes; 'low' (64 prompt tokens) got its first 32 and has 32 left."""
    h.add(req("dec", PROMPTS["dec"], arrival=100.0, priority=1, max_tokens=30))
    h.step()  # nothing decodes yet: 'dec' prefills alone
    h.add(req("low", PROMPTS["low"], arrival=100.0, priority=1, max_tokens=3))
    h.step()
    assert scheduled_counts(h.steps[-1]) == {"dec": 1, "low": 32}


def test_a_lower_class_chunk_leaves_the_room_for_a_waiting_first_tokens_prompt() -> None:
    h, clock = slo_harness(CLASSES, max_num_seqs=4, prefill_cap=32)
    start_a_half_prefilled_low_request(h)
    # The interactive class (500 ms) arrives. Its 24 tokens leave 8 of the 32: a step of
    # 2 decodes + 8 + 24 = 34 tokens ends at 100 + 0.1 + 0.34 = 100.44, before 100.5.
    high = h.add(req("high", PROMPTS["high"], arrival=100.0, priority=0, max_tokens=3))
    h.step()
    assert scheduled_counts(h.steps[-1]) == {"dec": 1, "low": 8, "high": 24}
    clock.now += 0.5
    h.run()
    for request_id, max_tokens in (("dec", 30), ("low", 3), ("high", 3)):  # outputs unchanged
        assert h.tokens[request_id] == reference_output(PROMPTS[request_id], max_tokens, 256), request_id
    assert high.num_preemptions == 0 and h.scheduler.num_preemptions_total == 0
    assert h.scheduler.kv.num_free_blocks == 64  # nothing leaked
    assert h.scheduler.get_stats()["slo_attained_requests.0"] == 1


def test_the_chunk_waits_a_step_when_even_those_tokens_would_make_the_first_token_late() -> None:
    h, _ = slo_harness(CLASSES, max_num_seqs=4, prefill_cap=32)
    start_a_half_prefilled_low_request(h)
    # Deadline 99.9 + 0.5 = 100.4: with 8 'low' tokens the step ends at 100.44, without them at
    # 100.36 (2 + 24 tokens). 'low' computes nothing this step; it keeps its seat and its blocks.
    h.add(req("high", PROMPTS["high"], arrival=99.9, priority=0, max_tokens=3))
    h.step()
    assert scheduled_counts(h.steps[-1]) == {"dec": 1, "high": 24}
    assert h.scheduler.requests["low"].status == RequestStatus.RUNNING
    h.scheduler.check_invariants()
    h.step()
    assert scheduled_counts(h.steps[-1])["low"] == 32  # the next step, the rest of its prompt
    h.run()
    assert h.tokens["low"] == reference_output(PROMPTS["low"], 3, 256)
    assert h.scheduler.kv.num_free_blocks == 64


def test_the_priority_policy_lets_the_running_chunk_split_the_first_tokens_prompt() -> None:
    # What the slo policy changes: under priority the running chunk takes the step's 32 prompt
    # tokens and the interactive request prefills in the next step.
    h = Harness(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=32, policy="priority")
    start_a_half_prefilled_low_request(h)
    h.add(make_request("high", PROMPTS["high"], max_tokens=3, priority=0, arrival_time=100.0))
    h.step()
    assert scheduled_counts(h.steps[-1]) == {"dec": 1, "low": 32}
    h.step()
    assert scheduled_counts(h.steps[-1]) == {"dec": 1, "low": 1, "high": 24}


def test_the_chunk_keeps_its_tokens_when_the_head_cannot_start_or_is_not_at_stake() -> None:
    cases = {  # classes, max_num_seqs, the head's priority and own TTFT target (ms)
        "no free seat (a loose target: no preemption)": ("0=60000/,1=60000/", 2, 0, None),
        "the head has no TTFT target": ("0=/100,1=60000/", 4, 0, None),
        "the head is of the same class": ("0=500/,1=60000/", 4, 1, 500),
    }
    for case, (classes, max_num_seqs, head_priority, ttft_ms) in cases.items():
        h, _ = slo_harness(SloConfig(classes=parse_slo_classes(classes)), max_num_seqs=max_num_seqs, prefill_cap=32)
        start_a_half_prefilled_low_request(h)
        h.add(req("high", PROMPTS["high"], arrival=100.0, ttft_ms=ttft_ms, priority=head_priority, max_tokens=3))
        h.step()
        assert scheduled_counts(h.steps[-1])["low"] == 32, case


def test_before_the_cost_model_is_ready_the_chunk_waits() -> None:
    h, _ = slo_harness(CLASSES, StepCostModel(min_steps=1000), max_num_seqs=4, prefill_cap=32)
    start_a_half_prefilled_low_request(h)
    h.add(req("high", PROMPTS["high"], arrival=100.0, priority=0, max_tokens=3))
    h.step()
    assert scheduled_counts(h.steps[-1]) == {"dec": 1, "high": 24}
