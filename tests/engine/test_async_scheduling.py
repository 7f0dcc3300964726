"""Async scheduling: the next step is scheduled and launched before the previous one's tokens
reach the host. Whatever the requests ask for, the output must equal running steps one at a time."""

from __future__ import annotations

import pytest

from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams


def _prompts(n: int, length: int = 20) -> list[list[int]]:
    return [[(11 * i + 17 * j) % 900 + 50 for j in range(length + i)] for i in range(n)]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir) -> dict[bool, LLM]:
    return {
        mode: LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, block_size=4, async_scheduling=mode)
        for mode in (False, True)
    }


def _both(engines: dict[bool, LLM], prompts, params: SamplingParams) -> tuple[list, list]:
    sync, overlapped = (
        engines[mode].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for mode in (False, True)
    )
    for llm in engines.values():
        assert not llm.engine.has_work()
        llm.engine.check_invariants()
    return sync, overlapped


def _summary(outputs) -> list:
    return [[(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in out.outputs] for out in outputs]


def test_the_engine_really_overlaps_steps(engines, tiny_llama_dir):
    llm = engines[True]
    prompt = _prompts(1)[0]
    request = llm.input_processor.make_request(
        "overlap", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )
    llm.engine.add_request(request)
    tokens: list[int] = []
    launched_ahead = 0
    steps = 0
    while llm.engine.has_work():
        for out in llm.engine.step():
            tokens.extend(out.new_token_ids)
        steps += 1
        launched_ahead += llm.engine._in_flight is not None
    assert tokens == hf_greedy(str(tiny_llama_dir), prompt, 6)[0]
    # Every step but the last returned with the next one already launched; and no step was
    # wasted past max_tokens: 6 launched steps (prefill + 5 decodes) and one to collect the last.
    assert steps == 7 and launched_ahead == 6


def test_stops_on_tokens_and_eos_match_sync(engines):
    prompts = _prompts(6)
    free_run = engines[False].generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        use_tqdm=False,
    )
    # Stop each request early on a token it would produce: the overlapped engine has already
    # launched the step after it when it learns of the stop, and must drop that step's token.
    stop_ids = sorted({out.outputs[0].token_ids[k] for k, out in zip(range(2, 8), free_run, strict=True)})
    sync, overlapped = _both(
        engines, prompts, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=stop_ids)
    )
    assert _summary(overlapped) == _summary(sync)
    assert any(c.finish_reason == "stop" for out in sync for c in out.outputs)


def test_stop_strings_seeds_logprobs_and_n_match_sync(engines):
    prompts = _prompts(4)
    tok = engines[False].get_tokenizer()
    free_run = engines[False].generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    text = tok.decode(free_run[1].outputs[0].token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    for params in (
        SamplingParams(temperature=0.0, max_tokens=10, stop=[stop], ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, logprobs=2, n=2),
        SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=10, ignore_eos=True),
    ):
        sync, overlapped = _both(engines, prompts, params)
        assert _summary(overlapped) == _summary(sync), params
        for a, b in zip(sync, overlapped, strict=True):
            for ca, cb in zip(a.outputs, b.outputs, strict=True):
                if ca.logprobs is not None:
                    assert [sorted(p) for p in ca.logprobs] == [sorted(p) for p in cb.logprobs]


def test_requests_needing_host_history_match_sync(engines):
    """Penalties, min_tokens and prompt logprobs make the engine wait before scheduling."""
    prompts = _prompts(3)
    for params in (
        SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=8, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1),
    ):
        sync, overlapped = _both(engines, prompts, params)
        assert _summary(overlapped) == _summary(sync), params
    # The wait ends when they do: plain requests overlap again.
    assert not engines[True].engine._needs_history


def test_abort_while_its_step_is_in_flight(engines, tiny_llama_dir):
    llm = engines[True]
    prompts = _prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(llm.input_processor.make_request(f"abort-{i}", prompt, params))
    tokens: dict[str, list[int]] = {"abort-0": [], "abort-1": []}
    finished: dict[str, str | None] = {}
    for _ in range(3):
        for out in llm.engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert llm.engine._in_flight is not None
    llm.engine.abort_requests(["abort-0"])
    while llm.engine.has_work():
        for out in llm.engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
    assert finished == {"abort-0": "abort", "abort-1": "length"}
    assert tokens["abort-1"] == hf_greedy(str(tiny_llama_dir), prompts[1], 8)[0]
    llm.engine.check_invariants()
    # Its launched steps wrote their KV, so its prompt stays in the prefix cache for a retry.
    again = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16
    assert again.outputs[0].token_ids == hf_greedy(str(tiny_llama_dir), prompts[0], 8)[0]
