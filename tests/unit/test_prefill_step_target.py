"""prefill_step_target_ms: the step-cost model of prefill tokens and decode rows, and how the
scheduler bounds a step's prefill beyond its first chunk with it (core/scheduler.py)."""

from __future__ import annotations

import itertools

import pytest

from tests.unit.test_scheduler import Harness, make_request, reference_output, scheduled_counts
from tokenmill.core.step_cost import PrefillDecodeCostModel, StepTimer


def test_cost_model_recovers_overhead_and_both_slopes() -> None:
    model = PrefillDecodeCostModel(min_steps=4)
    assert not model.ready and model.coefficients() == (0.0, 0.0, 0.0)
    for prefill, decode in itertools.islice(
        itertools.cycle([(0, 1), (32, 5), (128, 0), (64, 30), (0, 31)]), 60
    ):
        model.observe(prefill, decode, 0.04 + 0.002 * prefill + 0.0045 * decode)
    assert model.ready
    a, b, c = model.coefficients()
    assert a == pytest.approx(0.04, rel=0.05)
    assert b == pytest.approx(0.002, rel=0.05)
    assert c == pytest.approx(0.0045, rel=0.05)
    # Beside 30 decodes a 0.3 s step has room for (0.3 - 0.04 - 0.135) / 0.002 = 62 prompt tokens.
    assert model.prefill_tokens_within(0.3, 30) in (61, 62)
    assert model.prefill_tokens_within(0.1, 30) == 0  # the decodes alone take longer


def test_cost_model_skips_cold_steps_and_refuses_falling_slopes() -> None:
    model = PrefillDecodeCostModel(min_steps=2, skip_steps=3)
    for _ in range(3):
        model.observe(500, 0, 100.0)  # cold: left out, or the fit would be far off
    assert model.num_steps == 0
    for prefill in (10, 20, 30, 40):  # more prompt tokens, cheaper steps: noise, not a slope
        model.observe(prefill, 4, 1.0 - prefill / 100)
    a, b, c = model.coefficients()
    assert b == 0.0 and a >= 0.0 and c >= 0.0
    assert model.prefill_tokens_within(10.0, 4) == 1 << 30  # prompt tokens look free: no bound


def trained(h: Harness, per_token: float = 0.01, overhead: float = 0.0) -> None:
    """Give the scheduler's model a known cost: seconds = overhead + per_token x every token."""
    model = h.scheduler.step_cost
    assert model is not None
    for prefill, decode in itertools.islice(itertools.cycle([(0, 1), (10, 2), (30, 0), (5, 7)]), 40):
        model.observe(prefill, decode, overhead + per_token * (prefill + decode))
    assert model.ready


def test_idle_step_adds_prompts_only_within_the_target_and_never_splits_the_first() -> None:
    # 0.01 s a token, target 0.25 s: 25 prompt tokens fit in a step with nothing decoding.
    h = Harness(max_num_batched_tokens=64, prefill_step_target_ms=250)
    trained(h)
    prompts = {f"r{i}": list(range(100 * i + 1, 100 * i + 21)) for i in range(3)}  # 20 tokens each
    prompts["big"] = list(range(1000, 1040))  # 40 tokens: more than the target alone
    for rid in ("big", "r0", "r1", "r2"):
        h.add(make_request(rid, prompts[rid], max_tokens=3))
    h.step()
    assert scheduled_counts(h.steps[0]) == {"big": 40}  # the first prompt whole, nothing beside it
    h.run()
    for rid, prompt in prompts.items():
        assert h.tokens[rid] == reference_output(prompt, 3, 256)


def test_idle_step_fills_up_to_the_target_with_short_prompts() -> None:
    h = Harness(max_num_batched_tokens=64, prefill_step_target_ms=250)
    trained(h)
    prompts = {f"r{i}": list(range(100 * i + 1, 100 * i + 11)) for i in range(5)}  # 10 tokens each
    for rid, prompt in prompts.items():
        h.add(make_request(rid, prompt, max_tokens=2))
    h.step()
    # 10 + 10 + 5 = 25 tokens: the third prompt is chunked at the target (without it: all 50).
    assert scheduled_counts(h.steps[0]) == {"r0": 10, "r1": 10, "r2": 5}
    h.run()
    for rid, prompt in prompts.items():
        assert h.tokens[rid] == reference_output(prompt, 2, 256)


def test_target_off_or_model_not_ready_leaves_the_step_budget() -> None:
    for target in (0.0, 250.0):
        h = Harness(max_num_batched_tokens=64, prefill_step_target_ms=target)
        assert (h.scheduler.step_cost is None) == (target == 0.0)
        for i in range(5):
            h.add(make_request(f"r{i}", list(range(100 * i + 1, 100 * i + 11)), max_tokens=2))
        h.step()  # the model has seen no step yet (cold steps are left out): the whole budget
        assert sum(scheduled_counts(h.steps[0]).values()) == 50


def test_cap_while_decoding_is_kept_as_the_floor() -> None:
    # Decodes alone take longer than the target here: the cap still admits its prompt tokens.
    h = Harness(max_num_batched_tokens=64, max_prefill_tokens_while_decoding=6, prefill_step_target_ms=30)
    trained(h)
    h.add(make_request("first", 10, max_tokens=12))
    h.step()
    prompts = {"a": list(range(100, 115)), "b": list(range(200, 204))}
    for rid, prompt in prompts.items():
        h.add(make_request(rid, prompt, max_tokens=3))
    while "a" not in h.tokens or "b" not in h.tokens:
        h.step()
    # The cap's chunks exactly (as without a target): 15 + 4 prompt tokens at 6 a step.
    chunks = [scheduled_counts(so) for so in h.steps[1:5]]
    assert [c.get("a", 0) for c in chunks[:3]] == [6, 6, 3]
    assert [c.get("b", 0) for c in chunks] == [0, 0, 3, 1]
    h.run()
    for rid, prompt in prompts.items():
        assert h.tokens[rid] == reference_output(prompt, 3, 256)


def test_the_scheduler_learns_each_steps_prefill_and_decode_mix() -> None:
    h = Harness(max_num_batched_tokens=64, prefill_step_target_ms=250)
    now = [0.0]
    h.scheduler._step_timer = StepTimer(lambda: now[0])
    execute = h.runner.execute

    def timed(so):  # each step takes 0.01 + 0.002 s a prompt token + 0.005 s a decode row
        prefill = sum(n for n in so.num_scheduled_tokens.values() if n > 1)  # prompts of >= 3 tokens
        now[0] += 0.01 + 0.002 * prefill + 0.005 * (so.total_num_scheduled_tokens - prefill)
        return execute(so)

    h.runner.execute = timed
    for i in range(16):  # prompts arrive while others decode: steps of every mix (the first 8 are cold)
        h.add(make_request(f"r{i}", list(range(100 * i + 1, 100 * i + 4 + 3 * i)), max_tokens=4 + i % 5))
        for _ in range(1 + i % 3):
            h.step()
    h.run()
    model = h.scheduler.step_cost
    assert model is not None and model.ready
    a, b, c = model.coefficients()
    assert a == pytest.approx(0.01, abs=2e-3)
    assert b == pytest.approx(0.002, rel=0.1)
    assert c == pytest.approx(0.005, rel=0.1)


def test_target_trims_the_cap_while_decoding_down_to_the_floor() -> None:
    from tokenmill.core.scheduler import MIN_PREFILL_TOKENS_WHILE_DECODING

    prompt = list(range(100, 180))  # 80 tokens, below the cap of 100
    for per_token, expected in ((0.01, MIN_PREFILL_TOKENS_WHILE_DECODING), (0.001, len(prompt))):
        # 0.01 s a token: beside one decode ~24 prompt tokens fit in 0.25 s, so the floor (32) is
        # what the step takes; 0.001 s: ~249 fit, so the cap's room takes the whole prompt.
        h = Harness(max_num_batched_tokens=256, max_prefill_tokens_while_decoding=100, prefill_step_target_ms=250)
        trained(h, per_token=per_token)
        h.add(make_request("first", 10, max_tokens=12))
        h.step()  # "first" is prefilled and decodes from here on
        h.add(make_request("a", prompt, max_tokens=3))
        h.step()
        assert scheduled_counts(h.steps[1]) == {"first": 1, "a": expected}
        h.run()
        assert h.tokens["a"] == reference_output(prompt, 3, 256)
