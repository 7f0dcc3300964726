"""gpt-oss through the whole engine on the CPU: greedy tokens equal transformers' (eager attention,
which applies the sinks) in fp32 and logprobs within 1e-4, alone and batched, with chunked
prefill, preemption and prefix caching; concurrent requests also with async scheduling. Prompts
run several sliding windows (16 tokens) long, so the sliding layers' KV group drops blocks.

The checks are test_greedy_vs_transformers.py's over the tiny gpt-oss of tests/gpt_oss_checkpoint.py.
"""

from __future__ import annotations

import pytest

from tests import gpt_oss_checkpoint
from tests.engine import test_greedy_vs_transformers as dense_tests
from tests.engine.hf_oracle import hf_greedy, hf_prompt_logprobs, load_hf
from tests.engine.test_greedy_vs_transformers import MAX_NEW, _check_against_hf, _prompts
from tests.gpt_oss_checkpoint import GPT_OSS_WINDOW
from tokenmill import LLM, SamplingParams

tiny_gpt_oss_dir = gpt_oss_checkpoint.tiny_gpt_oss_dir
make_llm = dense_tests.make_llm  # the sync / async scheduling fixture


@pytest.fixture
def model(tiny_gpt_oss_dir) -> str:
    path = str(tiny_gpt_oss_dir)
    assert load_hf(path).config._attn_implementation == "eager"  # the oracle applies the sinks
    return path


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    return LLM(path, device="cpu", **kwargs)


def test_single_request_several_windows_long(model):
    llm = _llm(model)
    _check_against_hf(llm, model, _prompts(llm.info.vocab_size, 1, seed=1, min_len=70, max_len=70))


def test_concurrent_requests_of_different_lengths(make_llm, model):
    llm = make_llm(model)  # steps one at a time, and async scheduling
    _check_against_hf(llm, model, _prompts(llm.info.vocab_size, 6, seed=2, min_len=3, max_len=60))


def test_chunked_prefill_small_token_budget(model):
    llm = _llm(model, max_num_batched_tokens=8, max_num_seqs=4, block_size=4)
    prompts = _prompts(llm.info.vocab_size, 4, seed=3, min_len=2 * GPT_OSS_WINDOW, max_len=4 * GPT_OSS_WINDOW)
    _check_against_hf(llm, model, prompts)


def test_preemption_in_a_small_kv_pool(model):
    llm = _llm(model, num_kv_blocks=32, block_size=4, max_model_len=64)
    _check_against_hf(llm, model, _prompts(llm.info.vocab_size, 8, seed=4, min_len=17, max_len=30))
    assert llm.engine.get_stats()["num_preemptions_total"] > 0


def test_prefix_caching(model):
    llm = _llm(model, enable_prefix_caching=True, block_size=4)
    shared = _prompts(llm.info.vocab_size, 1, seed=5, min_len=40, max_len=40)[0]
    prompts = [shared + tail for tail in _prompts(llm.info.vocab_size, 3, seed=6, min_len=1, max_len=8)]
    _check_against_hf(llm, model, prompts[:1])  # warms the cache with the shared prefix
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, MAX_NEW)[0]
        assert out.num_cached_tokens > 0
    llm.engine.check_invariants()


def test_logprobs_match_transformers(model):
    llm = _llm(model)
    prompts = _prompts(llm.info.vocab_size, 2, seed=7, min_len=30, max_len=50)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, expected_lps = hf_greedy(model, prompt, MAX_NEW)
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        assert completion.logprobs is not None and len(completion.logprobs) == MAX_NEW
        for token, position, expected in zip(tokens, completion.logprobs, expected_lps, strict=True):
            assert position[token].logprob == pytest.approx(expected, abs=1e-4)
            assert position[token].rank == 1
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        expected_prompt = hf_prompt_logprobs(model, prompt)
        for token, position, expected in zip(prompt[1:], out.prompt_logprobs[1:], expected_prompt, strict=True):
            assert position[token].logprob == pytest.approx(expected, abs=1e-4)
