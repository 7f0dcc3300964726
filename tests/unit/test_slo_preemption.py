"""The `slo` policy frees seats for urgent higher classes: it preempts lower-class running requests.

No model: test_scheduler's fake runner (its "model" depends only on the sequence, so a preempted
request must resume to the same tokens), the slo queue on a fake clock and a cost model trained on
known step costs (test_slo_scheduler): every decision below is computed exactly in the comments.
Steps cost 0.1 s + 0.01 s per token.
"""

from __future__ import annotations

from tests.unit.test_scheduler import Harness, make_request, reference_output, scheduled
from tests.unit.test_slo_scheduler import req, slo_harness
from tokenmill.config import SloConfig
from tokenmill.core.request import RequestStatus
from tokenmill.core.step_cost import StepCostModel
from tokenmill.slo import parse_slo_classes

# Interactive class 0 must start within 500 ms; batch classes 1 and 2 within a minute.
CLASSES = SloConfig(classes=parse_slo_classes("0=500/,1=60000/,2=60000/"))


def prompt(length: int, seed: int) -> list[int]:
    """A prompt sharing no prefix with another seed's (no prefix-cache hit between them)."""
    return [(seed * 37 + 11 * j) % 90 + 5 for j in range(length)]


def new_ids(h: Harness) -> list[str]:
    return [s.request_id for s in scheduled(h.steps[-1]) if s.is_new]


def test_an_urgent_high_class_request_takes_the_seat_of_the_latest_low_class_one() -> None:
    h, clock = slo_harness(CLASSES, max_num_seqs=2)
    first = h.add(req("low-first", 4, arrival=100.0, priority=1, max_tokens=20))
    second = h.add(req("low-second", 4, arrival=100.0, priority=1, max_tokens=20))
    h.step()
    h.step()
    # Latest start 100.5 - 0.14 (its prefill); the first seat frees by itself after 18 decode steps
    # of 0.12 s: 2.16 s. It would miss: the latest-admitted batch request gives up its seat.
    high = h.add(req("high", 4, arrival=100.0, priority=0, max_tokens=3))
    h.step()
    assert h.steps[-1].preempted_req_ids == {"low-second"}
    assert second.status == RequestStatus.PREEMPTED and first.status == RequestStatus.RUNNING
    assert new_ids(h) == ["high"] and high.status == RequestStatus.RUNNING
    assert [r.request_id for r in h.scheduler.running] == ["high", "low-first"]  # by class
    clock.now += 0.3
    h.run()
    for request in (first, second, high):
        assert h.finals[request.request_id].finish_reason == "length"
        assert h.tokens[request.request_id] == reference_output(
            request.prompt_token_ids, request.max_tokens, 256
        ), request.request_id
    assert second.num_preemptions == 1 and first.num_preemptions == 0 and high.num_preemptions == 0
    assert h.scheduler.num_preemptions_total == 1
    assert h.scheduler.kv.num_free_blocks == 64  # nothing leaked
    assert h.scheduler.get_stats()["slo_attained_requests.0"] == 1


def test_a_high_class_request_with_time_to_spare_waits_for_a_seat() -> None:
    h, _ = slo_harness(SloConfig(classes=parse_slo_classes("0=10000/,1=60000/")), max_num_seqs=2)
    h.add(req("low-a", 4, arrival=100.0, priority=1, max_tokens=6))
    h.add(req("low-b", 4, arrival=100.0, priority=1, max_tokens=12))
    h.step()
    h.add(req("low-c", 4, arrival=99.0, priority=1, max_tokens=3))  # waits too, arrived first
    # A seat frees in 5 steps of 0.12 s, long before its latest start (100 + 10 - 0.14).
    high = h.add(req("high", 4, arrival=100.0, priority=0, max_tokens=3))
    h.step()
    assert not h.steps[-1].preempted_req_ids and high.status == RequestStatus.WAITING
    while high.status == RequestStatus.WAITING:
        h.step()
    assert new_ids(h) == ["high"]  # the first seat to free is its, ahead of the earlier batch request
    h.run()
    assert h.scheduler.num_preemptions_total == 0


def test_no_preemption_within_a_class_or_for_a_request_without_a_ttft_target() -> None:
    slo = SloConfig(classes=parse_slo_classes("0=/100,1=500/"))  # class 0: a TPOT target only
    h, _ = slo_harness(slo, max_num_seqs=1)
    h.add(req("low", 4, arrival=100.0, priority=1, max_tokens=20))
    h.step()
    h.add(req("low-urgent", 4, arrival=100.0, priority=1, max_tokens=2))  # urgent, but the same class
    h.add(req("high-untargeted", 4, arrival=100.0, priority=0, max_tokens=2))  # higher, but no TTFT
    for _ in range(5):
        h.step()
    assert h.scheduler.num_preemptions_total == 0
    assert [r.request_id for r in h.scheduler.running] == ["low"]


def test_the_lowest_class_goes_first_and_only_as_many_as_needed() -> None:
    h, _ = slo_harness(CLASSES, max_num_seqs=3)
    h.add(req("class1", 4, arrival=100.0, priority=1, max_tokens=20))
    h.add(req("class2-early", 4, arrival=90.0, priority=2, max_tokens=20))
    h.add(req("class0", 4, arrival=100.0, priority=0, max_tokens=20))
    h.step()
    assert [r.request_id for r in h.scheduler.running] == ["class0", "class1", "class2-early"]
    # Two urgent interactive requests, no free seat: the class-2 one goes first, then class 1;
    # the running class-0 request is never a victim of its own class.
    h.add(req("urgent-a", 4, arrival=100.0, priority=0, max_tokens=2))
    h.add(req("urgent-b", 4, arrival=100.0, priority=0, max_tokens=2))
    h.step()
    assert h.steps[-1].preempted_req_ids == {"class2-early", "class1"}
    assert sorted(new_ids(h)) == ["urgent-a", "urgent-b"]
    h.run()
    assert h.scheduler.num_preemptions_total == 2
    assert all(final.finish_reason == "length" for final in h.finals.values())


def test_a_lower_class_does_not_join_a_prefill_step_it_would_make_miss_a_first_token() -> None:
    h, _ = slo_harness(CLASSES, max_num_seqs=4, max_num_batched_tokens=64)
    h.add(req("low", prompt(16, 0), arrival=99.0, priority=1, max_tokens=3))
    h.add(req("high-a", prompt(16, 1), arrival=100.0, priority=0, max_tokens=3))
    h.add(req("high-b", prompt(16, 2), arrival=100.0, priority=0, max_tokens=3))
    h.step()
    # The two 16-token prompts end their step at 100 + 0.1 + 0.32, before the deadline 100.5;
    # with "low" too, 100.58: past it. Same class shares; "low" prefills next step.
    assert new_ids(h) == ["high-a", "high-b"]
    h.step()
    assert new_ids(h) == ["low"]
    h.run()
    assert all(final.finish_reason == "length" for final in h.finals.values())


def test_a_lower_class_joins_when_the_higher_first_token_has_time_or_no_target() -> None:
    for classes in ("0=60000/,1=60000/", "0=/100,1=60000/"):  # a loose TTFT target; a TPOT target only
        h, _ = slo_harness(SloConfig(classes=parse_slo_classes(classes)), max_num_seqs=4)
        h.add(req("high", prompt(16, 1), arrival=100.0, priority=0, max_tokens=3))
        h.add(req("low", prompt(16, 2), arrival=100.0, priority=1, max_tokens=3))
        h.step()
        assert new_ids(h) == ["high", "low"], classes


def test_one_free_seat_serves_the_first_urgent_request_and_one_victim_the_second() -> None:
    h, _ = slo_harness(CLASSES, max_num_seqs=3)
    h.add(req("low-a", 4, arrival=100.0, priority=1, max_tokens=20))
    h.add(req("low-b", 4, arrival=100.0, priority=1, max_tokens=20))
    h.step()
    h.add(req("urgent-a", 4, arrival=100.0, priority=0, max_tokens=2))
    h.add(req("urgent-b", 4, arrival=100.0, priority=0, max_tokens=2))
    h.step()
    assert h.steps[-1].preempted_req_ids == {"low-b"}
    assert sorted(new_ids(h)) == ["urgent-a", "urgent-b"]


def test_before_the_cost_model_is_ready_a_higher_class_preempts_at_once() -> None:
    h, _ = slo_harness(
        SloConfig(classes=parse_slo_classes("0=60000/,1=60000/")), StepCostModel(min_steps=1000), max_num_seqs=1
    )
    low = h.add(req("low", 4, arrival=100.0, priority=1, max_tokens=8))
    h.step()
    h.add(req("high", 4, arrival=100.0, priority=0, max_tokens=2))
    h.step()
    assert h.steps[-1].preempted_req_ids == {"low"} and new_ids(h) == ["high"]
    h.run()
    assert h.tokens["low"] == reference_output(low.prompt_token_ids, 8, 256)


def test_preemption_for_a_seat_under_async_scheduling_keeps_outputs_identical() -> None:
    h, clock = slo_harness(CLASSES, max_num_seqs=2)
    h.async_mode = True  # step N+1 is scheduled before step N's tokens are applied
    lows = [h.add(req(f"low{i}", 5 + i, arrival=100.0, priority=1, max_tokens=12)) for i in range(3)]
    for _ in range(4):
        h.step()
    highs = [h.add(req(f"high{i}", 3 + i, arrival=100.0, priority=0, max_tokens=5)) for i in range(2)]
    h.step()
    assert len(h.steps[-1].preempted_req_ids) == 2
    clock.now += 1.0
    h.run()
    h.flush()
    for request in lows + highs:
        assert h.tokens[request.request_id] == reference_output(
            request.prompt_token_ids, request.max_tokens, 256
        ), request.request_id
        assert h.finals[request.request_id].finish_reason == "length"
    assert sum(r.num_preemptions for r in lows) == 2
    h.scheduler.check_invariants()
    assert h.scheduler.kv.num_free_blocks == 64


def test_fcfs_and_priority_never_preempt_for_a_seat() -> None:
    for policy in ("fcfs", "priority"):
        h = Harness(max_num_seqs=1, policy=policy)
        h.add(make_request("low", 4, max_tokens=6, priority=1 if policy == "priority" else 0, arrival_time=1.0))
        h.step()
        h.add(make_request("high", 4, max_tokens=2, priority=0, arrival_time=2.0))
        h.run()
        assert h.scheduler.num_preemptions_total == 0, policy
        first_scheduled = [so.scheduled_new_reqs[0].request_id for so in h.steps if so.scheduled_new_reqs]
        assert first_scheduled == ["low", "high"], policy


def test_an_urgent_high_class_request_with_a_seat_but_no_kv_blocks_preempts_for_them() -> None:
    h, clock = slo_harness(CLASSES, max_num_seqs=4, num_blocks=10)
    low = h.add(req("low", prompt(28, 0), arrival=100.0, priority=1, max_tokens=8))
    h.step()  # 7 of the 10 blocks (4 tokens each); seats are free, blocks are not
    # 16 tokens need 4 blocks; 3 are free. Latest start 100.5 - 0.26; the blocks would come back
    # when "low" ends, 7 decode steps of 0.11 s away: it would miss, so "low" gives them back now.
    high = h.add(req("high", prompt(16, 1), arrival=100.0, priority=0, max_tokens=3))
    h.step()
    assert h.steps[-1].preempted_req_ids == {"low"} and new_ids(h) == ["high"]
    clock.now += 0.3
    h.run()
    for request in (low, high):
        assert h.tokens[request.request_id] == reference_output(request.prompt_token_ids, request.max_tokens, 256)
    assert h.scheduler.kv.num_free_blocks == h.scheduler.kv.num_usable_blocks  # nothing leaked


def test_a_high_class_request_with_time_to_spare_waits_for_kv_blocks() -> None:
    h, _ = slo_harness(SloConfig(classes=parse_slo_classes("0=60000/,1=60000/")), max_num_seqs=4, num_blocks=10)
    h.add(req("low", prompt(28, 0), arrival=100.0, priority=1, max_tokens=20))
    h.step()
    high = h.add(req("high", prompt(16, 1), arrival=100.0, priority=0, max_tokens=3))
    h.step()
    assert not h.steps[-1].preempted_req_ids and high.status == RequestStatus.WAITING
    h.run()
    assert h.scheduler.num_preemptions_total == 0 and h.finals["high"].finish_reason == "length"
