"""The `slo` policy keeps steps short enough for a higher class that may arrive while one runs.

No model: test_scheduler's fake runner, the slo queue on a fake clock and a cost model trained on
steps of 0.1 s + 0.01 s per token (test_slo_scheduler). A class-0 request has 500 ms to its first
token; once class 0 has sent requests of 8 tokens, its own prefill step is predicted at
0.1 + 0.01 x (8 + running decodes) s, and a lower class's step must end within what is left.
"""

from __future__ import annotations

from tests.unit.test_scheduler import Harness, make_request, reference_output, scheduled
from tests.unit.test_slo_preemption import prompt
from tests.unit.test_slo_scheduler import req, slo_harness
from tokenmill.config import SloConfig
from tokenmill.core.slo_queue import MIN_PREFILL_CHUNK
from tokenmill.slo import parse_slo_classes

CLASSES = SloConfig(classes=parse_slo_classes("0=500/,1=60000/"))


def chunks_of(h: Harness, request_id: str) -> list[int]:
    """The prompt tokens each step computed for `request_id` (its prefill chunks, then 1s)."""
    return [s.num_new_tokens for so in h.steps for s in scheduled(so) if s.request_id == request_id]


def serve_a_high_class_request(h: Harness) -> None:
    h.add(req("high", prompt(8, 1), arrival=100.0, priority=0, max_tokens=2))
    h.run()


def test_a_lower_class_prompt_is_chunked_to_keep_the_step_short_for_the_higher_class() -> None:
    h, _ = slo_harness(CLASSES, max_num_seqs=4, max_num_batched_tokens=256)
    serve_a_high_class_request(h)
    low = h.add(req("low", prompt(100, 2), arrival=100.0, priority=1, max_tokens=3))
    h.run()
    # Admitted with nothing running: the step may last 0.5 - (0.1 + 0.08) = 0.32 s, i.e.
    # (0.32 - 0.1) / 0.01 = 22 tokens. Then it runs (one running request: a class-0 arrival's step
    # would also carry its decode, 0.19 s, and so does this step): 21 - 1 = 20 tokens a step.
    # Without the cut it would be one 100-token step of 1.1 s.
    assert chunks_of(h, "low") == [22, 20, 20, 20, 18, 1, 1]
    assert h.tokens["low"] == reference_output(low.prompt_token_ids, 3, 256)  # chunking changes no token
    assert h.scheduler.kv.num_free_blocks == 64


def test_no_cut_before_a_higher_class_was_seen_nor_for_the_highest_class() -> None:
    h, _ = slo_harness(CLASSES, max_num_seqs=4, max_num_batched_tokens=256)
    h.add(req("low", prompt(100, 2), arrival=100.0, priority=1, max_tokens=2))
    h.run()
    assert chunks_of(h, "low")[0] == 100  # no class-0 request yet: nothing to keep steps short for
    serve_a_high_class_request(h)
    h.add(req("high-long", prompt(30, 3), arrival=100.0, priority=0, max_tokens=2))  # 0.4 s: in time
    h.run()
    assert chunks_of(h, "high-long")[0] == 30  # the highest class is never cut (a lower one: 22)


def test_a_hopelessly_tight_higher_target_still_lets_the_lower_class_progress() -> None:
    slo = SloConfig(classes=parse_slo_classes("0=150/,1=60000/"))  # 0.15 s < its own 0.18 s prefill step
    h, _ = slo_harness(slo, max_num_seqs=4, max_num_batched_tokens=256)
    serve_a_high_class_request(h)
    h.add(req("low", prompt(40, 2), arrival=100.0, priority=1, max_tokens=2))
    h.run()
    assert chunks_of(h, "low")[:3] == [MIN_PREFILL_CHUNK, MIN_PREFILL_CHUNK, 40 - 2 * MIN_PREFILL_CHUNK]
    assert h.finals["low"].finish_reason == "length"


def test_fcfs_and_priority_never_cut_a_prompt() -> None:
    for policy in ("fcfs", "priority"):
        h = Harness(max_num_seqs=4, max_num_batched_tokens=256, policy=policy)
        h.add(make_request("high", 8, max_tokens=2, priority=0, arrival_time=1.0))
        h.run()
        h.add(make_request("low", prompt(100, 2), max_tokens=2, priority=1 if policy == "priority" else 0))
        h.run()
        assert chunks_of(h, "low")[0] == 100, policy
        assert h.scheduler.waiting.prefill_chunk_limit(make_request("x", 100, priority=1), 0, 0) is None, policy


def test_the_cut_is_for_all_lower_class_chunks_of_a_step_together() -> None:
    h, _ = slo_harness(CLASSES, max_num_seqs=4, max_num_batched_tokens=256)
    serve_a_high_class_request(h)
    for i in range(3):
        h.add(req(f"low{i}", prompt(60, 2 + i), arrival=100.0, priority=1, max_tokens=2))
    h.step()
    # 22 tokens for the step, not 22 each: the first gets them, the others wait.
    assert chunks_of(h, "low0") == [22] and chunks_of(h, "low1") == chunks_of(h, "low2") == []
    h.run()
    assert all(h.finals[f"low{i}"].finish_reason == "length" for i in range(3))
    assert h.scheduler.kv.num_free_blocks == 64


def test_a_lower_class_chunk_waits_while_a_higher_first_token_is_about_to_prefill() -> None:
    h, _ = slo_harness(CLASSES, max_num_seqs=4, max_num_batched_tokens=256)
    serve_a_high_class_request(h)
    h.add(req("low", prompt(60, 2), arrival=100.0, priority=1, max_tokens=2))
    h.step()
    assert chunks_of(h, "low") == [22]
    h.add(req("high2", prompt(8, 5), arrival=100.0, priority=0, max_tokens=2))
    h.step()
    # The class-0 prompt prefills alone: the running class-1 prompt's next chunk waits a step.
    assert chunks_of(h, "high2") == [8] and chunks_of(h, "low") == [22]
    h.step()
    assert chunks_of(h, "low")[1] > 0
    h.run()
    assert h.finals["low"].finish_reason == "length" and h.finals["high2"].finish_reason == "length"
