"""A request the `slo` policy preempts for a higher class resumes to the tokens it would have made.

Tiny random Llama, greedy, fp32, with and without async scheduling: two batch-class requests fill
both seats and decode; an interactive one arrives, takes the seat of the later one (preempted
after it streamed tokens, recomputed later), and every output equals transformers' greedy tokens.
"""

from __future__ import annotations

import pytest

from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.engine.messages import EngineCoreRequest

MAX_NEW = 10


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_for_a_higher_class_and_resumed_matches_transformers(tiny_llama_dir, async_scheduling):
    llm = LLM(
        str(tiny_llama_dir), device="cpu", max_model_len=128, max_num_seqs=2, async_scheduling=async_scheduling,
        scheduling_policy="slo", slo_class="0=60000/,1=60000/",
    )  # fmt: skip
    core = llm.engine
    prompts = {
        "batch-a": [(7 * j + 3) % 200 + 20 for j in range(17)],
        "batch-b": [(11 * j + 5) % 200 + 20 for j in range(9)],
        "interactive": [(13 * j + 1) % 200 + 20 for j in range(6)],
    }
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    finals = {}

    def step() -> None:
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
        core.check_invariants()

    for rid, priority in (("batch-a", 1), ("batch-b", 1)):
        core.add_request(EngineCoreRequest(rid, prompts[rid], params, max_tokens=MAX_NEW, priority=priority))
    while len(tokens["batch-b"]) < 2:  # both seats taken, both streaming
        step()
    # Fewer steps than the cost model needs (8): no prediction yet, so a higher class preempts at once.
    assert not core.scheduler.waiting.cost.ready
    core.add_request(EngineCoreRequest("interactive", prompts["interactive"], params, max_tokens=MAX_NEW))
    while core.has_work():
        step()
    assert core.scheduler.num_preemptions_total == 1
    assert finals["batch-b"].timeline.preempted and not finals["batch-a"].timeline.preempted
    for rid, prompt in prompts.items():
        assert finals[rid].finish_reason == "length", rid
        assert tokens[rid] == hf_greedy(str(tiny_llama_dir), prompt, MAX_NEW)[0], rid
    assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_usable_blocks
