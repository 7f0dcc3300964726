"""Mixture-of-experts models through the whole engine on the CPU: greedy tokens equal
transformers' and logprobs within 1e-4, alone and batched, with chunked prefill, preemption and
prefix caching; concurrent requests also with async scheduling.

The checks are test_greedy_vs_transformers.py's, over the MoE fixtures of tests/moe_checkpoints.py
(fewer prompts: the transformers oracle decodes them one token at a time).
"""

from __future__ import annotations

import pytest

from tests import moe_checkpoints
from tests.engine import test_greedy_vs_transformers as dense_tests
from tests.engine.hf_oracle import hf_greedy, hf_prompt_logprobs
from tests.engine.test_greedy_vs_transformers import MAX_NEW, _check_against_hf, _prompts
from tests.moe_checkpoints import MOE_FIXTURES
from tokenmill import LLM, SamplingParams

# The tiny MoE checkpoints (session fixtures shared with the other MoE test modules).
tiny_mixtral_dir = moe_checkpoints.tiny_mixtral_dir
tiny_qwen2_moe_dir = moe_checkpoints.tiny_qwen2_moe_dir
tiny_qwen3_moe_dir = moe_checkpoints.tiny_qwen3_moe_dir
make_llm = dense_tests.make_llm  # the sync / async scheduling fixture


@pytest.fixture(params=MOE_FIXTURES)
def moe_model(request) -> str:
    return str(request.getfixturevalue(request.param))


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    return LLM(path, device="cpu", **kwargs)


def test_concurrent_requests_of_different_lengths(make_llm, moe_model):
    llm = make_llm(moe_model)  # steps one at a time, and async scheduling
    _check_against_hf(llm, moe_model, _prompts(llm.info.vocab_size, 6, seed=2))


def test_chunked_prefill_small_token_budget(moe_model):
    llm = _llm(moe_model, max_num_batched_tokens=8, max_num_seqs=4)
    _check_against_hf(llm, moe_model, _prompts(llm.info.vocab_size, 4, seed=3, min_len=10, max_len=40))


def test_preemption_in_a_small_kv_pool(moe_model):
    llm = _llm(moe_model, num_kv_blocks=8, block_size=4, max_model_len=40)
    _check_against_hf(llm, moe_model, _prompts(llm.info.vocab_size, 8, seed=4, min_len=5, max_len=16))
    assert llm.engine.get_stats()["num_preemptions_total"] > 0


def test_prefix_caching(moe_model):
    llm = _llm(moe_model, enable_prefix_caching=True, block_size=4)
    shared = _prompts(llm.info.vocab_size, 1, seed=5, min_len=40, max_len=40)[0]
    prompts = [shared + tail for tail in _prompts(llm.info.vocab_size, 3, seed=6, min_len=1, max_len=8)]
    _check_against_hf(llm, moe_model, prompts[:1])  # warms the cache with the shared prefix
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(moe_model, prompt, MAX_NEW)[0]
        assert out.num_cached_tokens >= 40
    llm.engine.check_invariants()


def test_logprobs_match_transformers(moe_model):
    llm = _llm(moe_model)
    prompts = _prompts(llm.info.vocab_size, 2, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, expected_lps = hf_greedy(moe_model, prompt, MAX_NEW)
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        assert completion.logprobs is not None and len(completion.logprobs) == MAX_NEW
        for token, position, expected in zip(tokens, completion.logprobs, expected_lps, strict=True):
            assert position[token].logprob == pytest.approx(expected, abs=1e-4)
            assert position[token].rank == 1
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        expected_prompt = hf_prompt_logprobs(moe_model, prompt)
        for token, position, expected in zip(prompt[1:], out.prompt_logprobs[1:], expected_prompt, strict=True):
            assert position[token].logprob == pytest.approx(expected, abs=1e-4)


def test_single_request_reads_only_active_experts_in_the_roofline(tiny_qwen3_moe_dir):
    """`bench latency`'s bytes per decode step: every weight but the input embedding and the
    routed experts a token does not use (8 experts, top-2: 6 unread per layer)."""
    from tokenmill.bench.latency import decode_bytes_per_step, embedding_bytes

    path = str(tiny_qwen3_moe_dir)
    llm = LLM(path, device="cpu", max_model_len=64)
    _check_against_hf(llm, path, _prompts(llm.info.vocab_size, 1, seed=1))
    model = llm.engine.runner.model
    weight_bytes, _ = decode_bytes_per_step(llm, 16, 16)
    expert_bytes = 3 * 64 * 48 * 4  # gate, up and down of one expert, fp32
    all_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes == all_bytes - embedding_bytes(llm) - 2 * 6 * expert_bytes
