"""Greedy output equals transformers' token for token, whatever the scheduler does.

Batching, chunked prefill, preemption, prefix caching and async scheduling must all leave greedy
output unchanged.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.hf_oracle import hf_greedy, hf_prompt_logprobs
from tokenmill import LLM, SamplingParams

TINY_MODELS = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]
MAX_NEW = 12


def _prompts(vocab_size: int, count: int, seed: int, min_len: int = 3, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(5, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)
    ]


def _check_against_hf(llm: LLM, path: str, prompts: list[list[int]], max_new: int = MAX_NEW) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert len(outputs) == len(prompts)
    for prompt, out in zip(prompts, outputs, strict=True):
        expected, _ = hf_greedy(path, prompt, max_new)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        assert out.outputs[0].finish_reason == "length"
    llm.engine.check_invariants()


@pytest.fixture(params=TINY_MODELS)
def tiny_model(request) -> str:
    return str(request.getfixturevalue(request.param))


@pytest.fixture(params=["sync", "async"])
def make_llm(request):
    """Every test runs with steps one at a time and with async scheduling (the next step
    scheduled and launched before the previous one's tokens reach the host)."""

    def make(path: str, **kwargs) -> LLM:
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("max_model_len", 256)
        return LLM(path, async_scheduling=request.param == "async", **kwargs)

    return make


def test_single_request(make_llm, tiny_model):
    llm = make_llm(tiny_model)
    _check_against_hf(llm, tiny_model, _prompts(llm.info.vocab_size, 1, seed=1))


def test_concurrent_requests_of_different_lengths(make_llm, tiny_model):
    llm = make_llm(tiny_model)
    _check_against_hf(llm, tiny_model, _prompts(llm.info.vocab_size, 17, seed=2))


def test_chunked_prefill_small_token_budget(make_llm, tiny_model):
    llm = make_llm(tiny_model, max_num_batched_tokens=8, max_num_seqs=4)
    _check_against_hf(llm, tiny_model, _prompts(llm.info.vocab_size, 6, seed=3, min_len=10, max_len=40))


def test_preemption_in_a_small_kv_pool(make_llm, tiny_model):
    # 10 blocks of 4 tokens: 16 requests that grow to ~30 tokens each cannot all stay resident.
    llm = make_llm(tiny_model, num_kv_blocks=10, block_size=4, max_model_len=40)
    _check_against_hf(llm, tiny_model, _prompts(llm.info.vocab_size, 16, seed=4, min_len=5, max_len=20))
    assert llm.engine.get_stats()["num_preemptions_total"] > 0


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_prefix_caching_on_and_off(make_llm, tiny_model, enable_prefix_caching):
    llm = make_llm(tiny_model, enable_prefix_caching=enable_prefix_caching, block_size=4)
    shared = _prompts(llm.info.vocab_size, 1, seed=5, min_len=40, max_len=40)[0]
    tails = _prompts(llm.info.vocab_size, 6, seed=6, min_len=1, max_len=8)
    prompts = [shared + t for t in tails]
    _check_against_hf(llm, tiny_model, prompts[:1])  # warms the cache with the shared prefix
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model, prompt, MAX_NEW)[0]
        if enable_prefix_caching:
            assert out.num_cached_tokens >= 40
        else:
            assert out.num_cached_tokens == 0
    llm.engine.check_invariants()


def test_logprobs_match_transformers(make_llm, tiny_model):
    llm = make_llm(tiny_model)
    prompts = _prompts(llm.info.vocab_size, 3, seed=7)
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, expected_lps = hf_greedy(tiny_model, prompt, MAX_NEW)
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        assert completion.logprobs is not None and len(completion.logprobs) == MAX_NEW
        for token, position, expected in zip(tokens, completion.logprobs, expected_lps, strict=True):
            assert position[token].logprob == pytest.approx(expected, abs=1e-4)
            assert position[token].rank == 1  # greedy picks the most likely token
            assert len(position) >= 3
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        expected_prompt = hf_prompt_logprobs(tiny_model, prompt)
        assert len(out.prompt_logprobs) == len(prompt)
        for token, position, expected in zip(
            prompt[1:], out.prompt_logprobs[1:], expected_prompt, strict=True
        ):
            assert position[token].logprob == pytest.approx(expected, abs=1e-4)


def test_n_greater_than_one_shares_prompt_blocks(make_llm, tiny_model):
    llm = make_llm(tiny_model, block_size=4)
    prompt = _prompts(llm.info.vocab_size, 1, seed=8, min_len=33, max_len=33)[0]
    out = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, n=3, max_tokens=6, ignore_eos=True)
    )[0]
    expected = hf_greedy(tiny_model, prompt, 6)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == expected for c in out.outputs)
    # The children after the first reuse the prompt's full blocks (32 of the 33 tokens).
    stats = llm.engine.get_stats()
    assert stats["prefix_cache_hits"] >= 2 * 32
    llm.engine.check_invariants()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_each_cpu_attention_backend_matches_transformers(tiny_llama_dir, backend):
    # `auto` picks the C++ kernels on CPU; the torch reference (gather + SDPA) stays selectable and
    # correct. A small budget makes prefill chunks short enough for the kernels to take them too.
    from tokenmill.kernels.cpu.build import cpu_kernels_available

    if backend == "cpu" and not cpu_kernels_available()[0]:
        pytest.skip(cpu_kernels_available()[1])
    path = str(tiny_llama_dir)
    llm = LLM(path, device="cpu", max_model_len=256, attention_backend=backend, max_num_batched_tokens=16)
    assert llm.engine.runner.model.attn_backend.name == backend
    _check_against_hf(llm, path, _prompts(llm.info.vocab_size, 12, seed=11, max_len=40))


def test_auto_attention_backend_on_cpu(tiny_llama_dir):
    from tokenmill.kernels.cpu.build import cpu_kernels_available

    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=64)
    expected = "cpu" if cpu_kernels_available()[0] else "torch"
    assert llm.engine.runner.model.attn_backend.name == expected
