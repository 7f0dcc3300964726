"""The `slo` scheduling policy with no model: least slack first, shedding, classes, goodput.

The scheduler runs on test_scheduler's fake runner; the slo queue gets a fake clock and a step
cost model fed known costs, so its predictions (and so its decisions) are exact.
"""

from __future__ import annotations

import pytest

from tests.unit.test_scheduler import FakeRunner, Harness, make_request, reference_output
from tokenmill.config import CacheConfig, SchedulerConfig, SloConfig
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.slo_queue import COLD_STEPS, SloQueue
from tokenmill.core.step_cost import StepCostModel, StepTimer
from tokenmill.slo import SloTarget, parse_slo_classes, resolve_target


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def trained_cost(overhead: float = 0.1, per_token: float = 0.01) -> StepCostModel:
    """A cost model that has seen steps costing exactly overhead + per_token * tokens."""
    cost = StepCostModel(decay=1.0, min_steps=4)
    for tokens in (1, 8, 32, 64, 4, 16):
        cost.observe(tokens, overhead + per_token * tokens)
    return cost


def slo_harness(
    slo: SloConfig = SloConfig(),
    cost: StepCostModel | None = None,
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    prefill_cap: int = 0,
) -> tuple[Harness, FakeClock]:
    """test_scheduler's Harness with the slo policy, a fake clock (still unless a test moves it)
    and a cost model that keeps the known costs it was trained on."""
    clock = FakeClock()
    h = Harness(num_blocks, block_size, max_num_seqs, max_num_batched_tokens)
    config = SchedulerConfig(
        max_num_seqs, max_num_batched_tokens, "slo", 256, slo, max_prefill_tokens_while_decoding=prefill_cap
    )
    h.scheduler = Scheduler(config, CacheConfig(block_size=block_size), num_blocks)
    cost = cost or trained_cost()
    cost.observe = lambda tokens, seconds: None  # type: ignore[method-assign]
    h.scheduler.waiting = SloQueue(config, clock=clock, cost=cost)
    h.runner = FakeRunner(h.scheduler)
    return h, clock


def req(request_id: str, prompt: int, arrival: float, ttft_ms: float | None = None, **kwargs) -> Request:
    return make_request(request_id, prompt, arrival_time=arrival, slo_ttft_ms=ttft_ms, **kwargs)


def test_cost_model_recovers_the_line_it_was_fed() -> None:
    overhead, per_token = trained_cost(0.05, 0.002).coefficients()
    assert overhead == pytest.approx(0.05) and per_token == pytest.approx(0.002)
    # 100 tokens in steps of 64 with 4 decodes besides: 2 steps of overhead + 4 decode tokens each.
    assert trained_cost(0.1, 0.01).seconds_for(100, 64, 4) == pytest.approx(2 * (0.1 + 0.04) + 1.0)
    # A prefill cap of 16 while 4 requests decode: 7 steps of at most 16 prompt tokens, not 2.
    assert trained_cost(0.1, 0.01).seconds_for(100, 64, 4, 16) == pytest.approx(7 * (0.1 + 0.04) + 1.0)
    # Nothing decoding: the cap does not apply (the scheduler's rule).
    assert trained_cost(0.1, 0.01).seconds_for(100, 64, 0, 16) == pytest.approx(2 * 0.1 + 1.0)
    assert not StepCostModel(min_steps=3).ready


def test_cost_model_leaves_the_first_cold_steps_out_of_its_fit() -> None:
    cost = StepCostModel(decay=1.0, min_steps=2, skip_steps=3)
    for tokens, seconds in ((96, 1.5), (2, 0.8), (2, 0.5)):  # cold: several times the warm cost
        cost.observe(tokens, seconds)
    assert not cost.ready and cost.coefficients() == (0.0, 0.0)
    for tokens in (2, 96):
        cost.observe(tokens, 0.05 + 0.004 * tokens)
    assert cost.ready
    assert cost.coefficients() == (pytest.approx(0.05), pytest.approx(0.004))
    # The slo queue's own model skips the engine's first steps.
    queue = SloQueue(SchedulerConfig(8, 64, "slo", 256, SloConfig()))
    assert queue.cost.skip_steps == COLD_STEPS > 0


def test_step_timer_starts_a_step_at_the_later_of_schedule_and_previous_result() -> None:
    clock = FakeClock()
    timer = StepTimer(clock)
    timer.scheduled()  # step 1 at 100
    clock.now = 100.5
    timer.scheduled()  # step 2 scheduled while step 1 runs (async scheduling)
    clock.now = 101.0
    assert timer.finished() == pytest.approx(1.0)
    clock.now = 101.25
    assert timer.finished() == pytest.approx(0.25)  # from step 1's result, not from 100.5
    assert timer.finished() is None


def test_waiting_requests_go_least_slack_first_and_untargeted_last() -> None:
    h, _ = slo_harness(max_num_seqs=1, max_num_batched_tokens=64)
    # Latest starts: loose 100 + 10 - 0.14 ; tight 101 + 0.5 - 0.14 ; long-but-tight: 100.8 + 1 - 0.74.
    h.add(req("none", 4, arrival=99.0))
    h.add(req("loose", 4, arrival=100.0, ttft_ms=10_000))
    h.add(req("tight", 4, arrival=101.0, ttft_ms=500))
    h.add(req("long", 60, arrival=100.8, ttft_ms=1_000))
    assert [r.request_id for r in h.scheduler.waiting] == ["long", "tight", "loose", "none"]
    h.run()
    first_scheduled = [so.scheduled_new_reqs[0].request_id for so in h.steps if so.scheduled_new_reqs]
    assert first_scheduled == ["long", "tight", "loose", "none"]
    assert all(final.finish_reason == "length" for final in h.finals.values())


def test_hopeless_requests_are_shed_without_leaking_and_others_are_untouched() -> None:
    h, clock = slo_harness(max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64)
    # Latest start 100 + 0.4 - (0.1 + 0.2): first in slack order among the ones that can make it.
    keep = h.add(req("keep", 20, arrival=100.0, ttft_ms=400, max_tokens=6))
    # 40 tokens need 0.1 + 0.4 = 0.5 s of prefill: a 300 ms target cannot be met even now.
    h.add(req("hopeless", 40, arrival=100.0, ttft_ms=300))
    # Behind "keep" in slack order (latest start 100.18), it would make it alone (0.5 s) but not
    # after keep's 20 tokens (0.1 + 0.6 = 0.7 s): shed too. The retry-after covers the queue left.
    h.add(req("behind", 40, arrival=100.0, ttft_ms=680))
    h.step()
    assert h.finals["hopeless"].finish_reason == "shed" and h.finals["behind"].finish_reason == "shed"
    assert h.finals["hopeless"].retry_after == 1.0
    assert "time-to-first-token target of 300 ms" in h.finals["hopeless"].error
    assert h.tokens["hopeless"] == [] and h.tokens["behind"] == []
    clock.now += 0.2
    h.run()
    assert h.finals["keep"].finish_reason == "length"
    assert h.tokens["keep"] == reference_output(keep.prompt_token_ids, 6, 256)
    assert h.scheduler.kv.usage == 0 and h.scheduler.kv.num_free_blocks == 64
    stats = h.scheduler.get_stats()
    assert stats["slo_shed_requests.default"] == 2 and stats["slo_missed_requests.default"] == 2
    assert stats["slo_goodput_requests"] == 1 and stats["slo_attained_requests.default"] == 1


@pytest.mark.parametrize(("prefill_cap", "shed"), [(0, False), (16, True)])
def test_shedding_counts_the_prefill_cap_while_requests_decode(prefill_cap, shed) -> None:
    """One request decoding: a 40-token prompt needs one step uncapped (0.1 + 0.01 + 0.4 = 0.51 s,
    inside its 600 ms) but three under a cap of 16 (3 x 0.11 + 0.4 = 0.73 s: shed)."""
    h, clock = slo_harness(max_num_batched_tokens=64, prefill_cap=prefill_cap)
    h.add(req("decoder", 4, arrival=100.0, max_tokens=20))
    h.step()  # its prefill; it decodes from now on
    h.add(req("late", 40, arrival=clock.now, ttft_ms=600, max_tokens=2))
    h.step()
    assert ("late" in h.finals and h.finals["late"].finish_reason == "shed") is shed
    h.run()
    assert h.scheduler.kv.usage == 0


def test_nothing_is_shed_before_the_cost_model_has_seen_enough_steps() -> None:
    h, clock = slo_harness(cost=StepCostModel(min_steps=1000))
    h.add(req("late", 8, arrival=90.0, ttft_ms=1))  # already 10 s past its target
    h.run()
    assert h.finals["late"].finish_reason == "length"
    assert h.scheduler.get_stats()["slo_missed_requests.default"] == 1


def test_a_request_that_streamed_tokens_is_never_shed_even_after_preemption() -> None:
    # Two requests fill the 6-block pool as they decode: the one admitted last (the looser target)
    # is preempted after it produced tokens and waits past its deadline; it must resume, never be shed.
    h, clock = slo_harness(num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    tight = h.add(req("tight", 7, arrival=100.0, ttft_ms=1_000, max_tokens=15))
    victim = h.add(req("victim", 7, arrival=100.0, ttft_ms=5_000, max_tokens=15))
    for _ in range(200):
        h.step()
        if victim.num_preemptions:
            break
    assert victim.num_preemptions and victim.num_output_tokens > 0
    clock.now += 100.0  # far past every deadline
    h.run()
    assert h.finals["victim"].finish_reason == "length"
    assert h.tokens["victim"] == reference_output(victim.prompt_token_ids, 15, 256)
    assert h.tokens["tight"] == reference_output(tight.prompt_token_ids, 15, 256)


def test_priority_classes_set_targets_and_count_attainment_by_class() -> None:
    slo = SloConfig(ttft_ms=None, tpot_ms=None, classes=parse_slo_classes("0=400/,1=60000/"))
    h, clock = slo_harness(slo, max_num_seqs=1, max_num_batched_tokens=64)
    h.add(req("batch", 8, arrival=99.0, priority=1))
    h.add(req("interactive", 8, arrival=100.0, priority=0))
    h.add(req("own-target", 8, arrival=100.0, priority=0, ttft_ms=120_000))  # its own field wins
    # Priority first, then slack: batch (priority 1) waits behind both priority 0 requests.
    assert [r.request_id for r in h.scheduler.waiting] == ["interactive", "own-target", "batch"]
    h.step()
    clock.now += 0.2  # interactive's first token at 100.2: within 400 ms
    h.run()
    stats = h.scheduler.get_stats()
    assert stats["slo_attained_requests.0"] == 2 and stats["slo_attained_requests.1"] == 1
    assert stats["slo_goodput_requests"] == 3


def test_a_missed_tpot_target_is_counted_missed() -> None:
    h, clock = slo_harness(SloConfig(tpot_ms=50.0), max_num_batched_tokens=64)
    h.add(req("slow", 4, arrival=100.0, max_tokens=3))
    while "slow" not in h.finals:
        h.step()
        clock.now += 0.1  # 100 ms a token
    stats = h.scheduler.get_stats()
    assert stats["slo_missed_requests.default"] == 1 and stats["slo_goodput_requests"] == 0


def test_resolve_target_order_and_class_parsing_errors() -> None:
    slo = SloConfig(ttft_ms=1000, tpot_ms=100, classes=((0, 200, None), (5, None, 30)))
    assert resolve_target(slo, 0, None, None) == SloTarget(0.2, 0.1, "0")
    assert resolve_target(slo, 5, 50, None) == SloTarget(0.05, 0.03, "5")
    assert resolve_target(slo, 3, None, None) == SloTarget(1.0, 0.1, "default")
    assert resolve_target(SloConfig(), 0, None, None).is_empty
    for bad, words in [
        ("0=500", "PRIORITY=TTFT_MS/TPOT_MS"),
        ("x=5/5", "must be an integer"),
        ("0=/", "sets no target"),
        ("0=-5/", "positive number"),
        ("0=5/,0=6/", "two SLO classes"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_slo_classes(bad)


def test_a_shed_request_is_never_reported_twice_when_aborted_later() -> None:
    h, _ = slo_harness()
    h.add(req("hopeless", 40, arrival=100.0, ttft_ms=1))
    h.step()
    assert h.finals["hopeless"].finish_reason == "shed"
    assert h.abort("hopeless") == []  # already gone
    assert h.scheduler.get_stats()["slo_shed_requests.default"] == 1
    assert RequestStatus.FINISHED_SHED.finish_reason == "shed"


def test_slo_targets_under_another_policy_end_the_request_naming_the_fields() -> None:
    # Offline (no API server to refuse them first) the engine must not ignore them silently.
    h = Harness()  # fcfs
    h.add(req("targeted", 8, 0.0, ttft_ms=500.0))
    h.add(req("plain", 8, 0.0))
    for _ in range(10):
        h.step()
    final = h.finals["targeted"]
    assert final.finish_reason == "error" and "slo_ttft_ms" in (final.error or "") and "'slo'" in final.error
    assert h.tokens["targeted"] == [] and h.finals["plain"].finish_reason == "length"
