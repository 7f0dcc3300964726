"""Sliding-window models through the whole engine: greedy tokens equal transformers' in fp32 on
prompts several windows long, while every scheduled request's blocks in a sliding KV cache group
stay bounded by the window (checked after every schedule), alone, batched with chunked prefill,
under preemption, with prefix caching, and with a pool smaller than one full-length sequence.

Two tiny checkpoints (sliding_window_checkpoints.py): Mistral with a 32-token window on every layer
(one sliding group), and Qwen2 with `use_sliding_window` on layers 0 and 2 of 4 (a full and a
sliding group of two layers each, sharing the pool's two tensors). The torch reference backend
serves the windows (the C++ one too, batched).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.hf_oracle import hf_greedy
from tests.engine.sliding_window_checkpoints import (
    CHECKPOINTS,
    WINDOW,
    WindowBound,
    random_prompts,
    write_sliding_checkpoint,
)
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_cache_groups import max_live_sliding_blocks

BLOCK_SIZE = 16
MAX_NEW = 20


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def model_path(request, tmp_path_factory, tiny_tokenizer) -> str:
    return str(write_sliding_checkpoint(tmp_path_factory.mktemp(request.param), request.param, tiny_tokenizer))


def _check_greedy(llm: LLM, path: str, prompts: list[list[int]]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        expected, _ = hf_greedy(path, prompt, MAX_NEW)
        assert out.outputs[0].token_ids == expected, f"{len(prompt)}-token prompt diverged"
    llm.engine.check_invariants()
    kv = llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks, "blocks leaked"
    return outputs


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("block_size", BLOCK_SIZE)
    kwargs.setdefault("attention_backend", "torch")
    return LLM(path, device="cpu", **kwargs)


def test_alone_several_windows_long(model_path: str) -> None:
    llm = _llm(model_path)
    bound = WindowBound(llm)
    [prompt] = random_prompts(llm.info.vocab_size, 1, seed=1, min_len=100, max_len=100)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    tokens, logprobs = hf_greedy(model_path, prompt, MAX_NEW)
    assert out.outputs[0].token_ids == tokens
    assert out.outputs[0].logprobs is not None
    for token, position, expected in zip(tokens, out.outputs[0].logprobs, logprobs, strict=True):
        assert position[token].logprob == pytest.approx(expected, abs=1e-4)
    assert bound.num_checks == 1 + MAX_NEW - 1  # the prefill, then one decode per token but the last
    for group in bound.sliding_groups():
        # The prefill chunk holds all its 7 blocks; every decode after it at most ceil(32/16) + 1.
        assert bound.max_live[group] == 7
    llm.engine.check_invariants()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_batched_with_chunked_prefill(model_path: str, async_scheduling: bool, backend: str) -> None:
    """Also on the C++ backend, which reads each group's block tables in place."""
    from tokenmill.kernels.cpu.build import cpu_kernels_available

    if backend == "cpu" and not cpu_kernels_available()[0]:
        pytest.skip(cpu_kernels_available()[1])
    llm = _llm(
        model_path, max_num_batched_tokens=24, max_num_seqs=4, async_scheduling=async_scheduling,
        attention_backend=backend,
    )  # fmt: skip
    bound = WindowBound(llm)
    prompts = random_prompts(llm.info.vocab_size, 6, seed=2, min_len=70, max_len=130)
    _check_greedy(llm, model_path, prompts)
    for group in bound.sliding_groups():
        assert bound.max_live[group] <= max_live_sliding_blocks(WINDOW, BLOCK_SIZE, 24)


def test_preemption_in_a_small_pool(model_path: str) -> None:
    # 4-token blocks, 12-token chunks: a request holds at most ceil((31 + 12) / 4) + 1 = 12 blocks
    # per sliding group, 9 while it decodes; Mistral's 33 usable blocks cannot keep four requests
    # running, nor can Qwen2's 59 two whose full group grows to ~33 blocks each.
    num_blocks = 34 if "mistral" in model_path else 60
    llm = _llm(
        model_path, max_model_len=160, block_size=4, num_kv_blocks=num_blocks, max_num_batched_tokens=12,
        max_num_seqs=4,
    )  # fmt: skip
    bound = WindowBound(llm)
    prompts = random_prompts(llm.info.vocab_size, 5, seed=3, min_len=70, max_len=110)
    _check_greedy(llm, model_path, prompts)
    assert llm.engine.get_stats()["num_preemptions_total"] > 0
    assert bound.num_checks > 0


def test_prefix_caching_after_the_first_request_slid_past_its_prefix(model_path: str) -> None:
    llm = _llm(model_path, enable_prefix_caching=True)
    bound = WindowBound(llm)
    shared = random_prompts(llm.info.vocab_size, 1, seed=4, min_len=96, max_len=96)[0]
    tails = random_prompts(llm.info.vocab_size, 3, seed=5, min_len=5, max_len=30)
    # The first request decodes 20 tokens past its 101+ prompt: its sliding blocks before the last
    # window went back to the pool, still cached.
    _check_greedy(llm, model_path, [shared + tails[0]])
    outputs = _check_greedy(llm, model_path, [shared + tail for tail in tails[1:]])
    for out in outputs:
        assert out.num_cached_tokens >= 96  # the shared prefix's 6 blocks, in every group
    stats = llm.engine.get_stats()
    assert stats["prefix_cache_hits"] >= 2 * 96
    assert bound.num_checks > 0


def test_a_pool_smaller_than_one_full_sequence_serves_a_mistral(tmp_path: Path, tiny_tokenizer) -> None:
    """Memory follows the window: 7 blocks of 16 (one of them the null block) serve 150-token
    sequences when prefill chunks are 32 tokens (at most ceil((31 + 32) / 16) + 1 = 5 live)."""
    path = str(write_sliding_checkpoint(tmp_path, "mistral", tiny_tokenizer))
    llm = _llm(path, num_kv_blocks=7, max_num_batched_tokens=32, max_num_seqs=1)
    bound = WindowBound(llm)
    prompts = random_prompts(llm.info.vocab_size, 2, seed=6, min_len=120, max_len=130)
    _check_greedy(llm, path, prompts)
    assert max(bound.max_live.values()) <= 5
    assert 7 * BLOCK_SIZE < 150  # a full-attention model could not hold even one of these sequences
