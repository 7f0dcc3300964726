"""The scheduler -> runner step contract is serializable, and the runner keeps its own state.

An engine whose runner only ever sees a msgpack round trip of each SchedulerOutput (as a runner
in another process would) must produce exactly what an engine handing the object over in
process produces: with chunked prefill, preemption, seeded sampling, penalties, logprobs and
prompt logprobs in the mix.
"""

from __future__ import annotations

import msgspec
import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.outputs import SchedulerOutput


def _prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j) % 900 + 40 for j in range(9 + 5 * i)] for i in range(n)]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.8, seed=5, max_tokens=10, ignore_eos=True),
        SamplingParams(
            temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, min_tokens=4, max_tokens=9
        ),
        SamplingParams(temperature=0.7, top_k=20, seed=11, logprobs=2, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, prompt_logprobs=1, logprobs=0, max_tokens=6, ignore_eos=True),
    ]


def _make(tiny_llama_dir) -> LLM:
    # A small pool and budget: prefills are chunked and requests get preempted and resumed.
    return LLM(
        str(tiny_llama_dir),
        device="cpu",
        max_model_len=64,
        block_size=4,
        num_kv_blocks=14,
        max_num_batched_tokens=16,
        async_scheduling=False,
    )


def _summary(outputs) -> list:
    return [
        [(c.token_ids, c.finish_reason, c.logprobs) for c in out.outputs] + [out.prompt_logprobs]
        for out in outputs
    ]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list:
    llm = _make(tiny_llama_dir)
    prompts = [{"prompt_token_ids": p} for p in _prompts(5)]
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0, "the test should exercise a resume"
    return _summary(outputs)


def test_runner_fed_decoded_scheduler_outputs_gives_identical_results(tiny_llama_dir, reference):
    llm = _make(tiny_llama_dir)
    runner = llm.engine.runner
    real_execute_async = runner.execute_async
    seen = {"new": 0, "cached": 0, "preempted": 0, "resumed": 0}

    def execute_decoded(so: SchedulerOutput):
        wire = msgspec.msgpack.encode(so)
        decoded = msgspec.msgpack.decode(wire, type=SchedulerOutput)
        assert decoded == so
        assert list(decoded.num_scheduled_tokens) == list(so.num_scheduled_tokens)  # the batch order
        seen["new"] += len(so.scheduled_new_reqs)
        seen["cached"] += len(so.scheduled_cached_reqs.request_ids)
        seen["preempted"] += len(so.preempted_req_ids)
        seen["resumed"] += sum(1 for new in so.scheduled_new_reqs if new.output_token_ids)
        return real_execute_async(decoded)

    runner.execute_async = execute_decoded
    prompts = [{"prompt_token_ids": p} for p in _prompts(5)]
    outputs = llm.generate(prompts, _params(), use_tqdm=False)
    assert _summary(outputs) == reference
    assert seen["cached"] > seen["new"] > 0 and seen["preempted"] > 0 and seen["resumed"] > 0
    # Everything ended: the runner dropped every request's state with the next step's finished ids.
    llm.engine.step()
    assert len(runner.requests) == 0 and not runner.generators
    llm.engine.check_invariants()


def test_drafts_set_by_hand_are_verified_by_the_runner(tiny_llama_dir):
    """The step contract's draft tokens reach the runner's verification with no proposer configured:
    right drafts are kept, a wrong one is replaced by the model's own token, output unchanged."""
    llm = _make(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = _prompts(1)[0]
    expected = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.add_request(llm.input_processor.make_request("drafted", prompt, params))
    [first] = llm.engine.step()  # the prefill
    assert first.new_token_ids == expected[:1]
    # Two right drafts, then a wrong one: 2 kept + the model's own third token.
    llm.engine.scheduler.requests["drafted"].spec_token_ids = [expected[1], expected[2], expected[3] + 1]
    [out] = llm.engine.step()
    assert out.new_token_ids == expected[1:4]
    tokens = first.new_token_ids + out.new_token_ids
    while llm.engine.has_work():
        for out in llm.engine.step():
            tokens += out.new_token_ids
    assert tokens == expected
    llm.engine.step()  # the runner drops ended requests with the next step's finished ids
    assert len(llm.engine.runner.requests) == 0
    llm.engine.check_invariants()
