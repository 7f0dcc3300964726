"""Phi-3 (LongRoPE short and long, partial rotary, sliding window), Mistral with its sliding window,
Qwen2 with YaRN and Llama with linear RoPE scaling: greedy tokens equal transformers' in fp32 and
logprobs are within 1e-4, alone and batched with chunked prefill, prefix caching and preemption.

Each checkpoint's prompts keep transformers on the RoPE factors our table holds (see
rope_window_checkpoints.SPECS); sliding-window prompts span three to four windows.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.hf_oracle import hf_greedy, hf_prompt_logprobs
from tests.engine.rope_window_checkpoints import SPECS, WINDOW, write_checkpoint
from tokenmill import LLM, SamplingParams

MAX_NEW = 10
BLOCK_SIZE = 16


@pytest.fixture(scope="module", params=list(SPECS))
def model(request, tmp_path_factory, tiny_tokenizer) -> tuple[str, int, int]:
    """(checkpoint path, the engine's max_model_len, the shortest prompt the spec allows)."""
    name = request.param
    seed = 20 + list(SPECS).index(name)
    path = write_checkpoint(tmp_path_factory.mktemp(name), name, tiny_tokenizer, seed)
    _, _, max_model_len, min_len = SPECS[name]
    return str(path), max_model_len, min_len


def _prompts(vocab_size: int, count: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def _greedy(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_alone_tokens_and_logprobs(model):
    path, max_model_len, min_len = model
    llm = LLM(path, device="cpu", max_model_len=max_model_len, block_size=BLOCK_SIZE)
    prompt = _prompts(llm.info.vocab_size, 1, seed=1, min_len=max(min_len, 40), max_len=max(min_len, 40) + 30)[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    tokens, expected = hf_greedy(path, prompt, MAX_NEW)
    completion = out.outputs[0]
    assert completion.token_ids == tokens
    assert completion.logprobs is not None
    for token, position, lp in zip(tokens, completion.logprobs, expected, strict=True):
        assert position[token].logprob == pytest.approx(lp, abs=1e-4)
    assert out.prompt_logprobs is not None
    for token, position, lp in zip(prompt[1:], out.prompt_logprobs[1:], hf_prompt_logprobs(path, prompt), strict=True):
        assert position[token].logprob == pytest.approx(lp, abs=1e-4)


def test_batched_chunked_prefill_with_prefix_caching(model):
    """Prompts sharing a 48-token prefix, prefilled in 16-token chunks alongside each other's
    decodes; after the first, the shared full blocks come from the prefix cache."""
    path, max_model_len, min_len = model
    llm = LLM(
        path, device="cpu", max_model_len=max_model_len, block_size=BLOCK_SIZE, enable_prefix_caching=True,
        max_num_batched_tokens=16, max_num_seqs=4,
    )  # fmt: skip
    shared = _prompts(llm.info.vocab_size, 1, seed=2, min_len=48, max_len=48)[0]
    tails = _prompts(llm.info.vocab_size, 5, seed=3, min_len=max(1, min_len - 48), max_len=max(12, min_len - 20))
    prompts = [shared + tail for tail in tails]
    first = _greedy(llm, prompts[:1])[0]
    assert first.outputs[0].token_ids == hf_greedy(path, prompts[0], MAX_NEW)[0]
    for prompt, out in zip(prompts[1:], _greedy(llm, prompts[1:]), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0], f"{len(prompt)}-token prompt"
        assert out.num_cached_tokens >= 48
    llm.engine.check_invariants()


def test_preemption_in_a_small_kv_pool(model):
    path, _, min_len = model
    # Sliding-window prompts here are 1.25 to 2 windows long: long prompts would leave a pool of
    # one max_model_len sequence room for every request once blocks slide out of the window.
    min_len = min(min_len, WINDOW + 8)
    max_len = min_len + 20
    max_model_len = max_len + MAX_NEW
    # Blocks of 4 for one max_model_len sequence and 16-token steps: requests are admitted a chunk
    # at a time while blocks are free, run out of them as they grow, and the latest are preempted
    # and recomputed (also where sliding layers free the blocks behind their window).
    llm = LLM(
        path, device="cpu", max_model_len=max_model_len, block_size=4, num_kv_blocks=-(-max_model_len // 4),
        max_num_batched_tokens=16, max_num_seqs=8,
    )  # fmt: skip
    prompts = _prompts(llm.info.vocab_size, 8, seed=4, min_len=min_len, max_len=max_len)
    for prompt, out in zip(prompts, _greedy(llm, prompts), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0], f"{len(prompt)}-token prompt"
    assert llm.engine.get_stats()["num_preemptions_total"] > 0
    llm.engine.check_invariants()


@pytest.mark.parametrize("name", ["phi3_sliding", "mistral_sliding"])
def test_sliding_window_on_the_torch_reference_backend(name, tmp_path, tiny_tokenizer):
    """The tests above run the default CPU backend (the C++ kernels where they build); the torch
    reference honours the window too, in chunks that start past the first window."""
    path = str(write_checkpoint(tmp_path, name, tiny_tokenizer, seed=40))
    _, _, max_model_len, min_len = SPECS[name]
    llm = LLM(
        path, device="cpu", max_model_len=max_model_len, block_size=BLOCK_SIZE, attention_backend="torch",
        max_num_batched_tokens=24,
    )  # fmt: skip
    assert llm.engine.runner.model.attn_backend.name == "torch"
    prompts = _prompts(llm.info.vocab_size, 3, seed=5, min_len=min_len, max_len=min_len + 30)
    for prompt, out in zip(prompts, _greedy(llm, prompts), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0], f"{len(prompt)}-token prompt"
