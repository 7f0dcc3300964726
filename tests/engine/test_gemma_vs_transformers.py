"""Gemma 2 and Gemma 3 (text) through the whole engine equal transformers on the same weights.

fp32 on the CPU: greedy tokens token for token (each our argmax = transformers' argmax on the
same tokens), the chosen tokens' logprobs and every prompt token's logprob within 1e-4, whatever
the scheduler does (one request, a batch, chunked prefill,
preemption, prefix caching, async scheduling), on prompts several sliding windows long (windows
of 16 and 24 tokens, tests/engine/gemma_checkpoints.py). transformers runs Gemma 2 with its eager
attention (the one that soft-caps). Also a Gemma3ForConditionalGeneration checkpoint's text model.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from tests.engine import gemma_checkpoints
from tests.engine.gemma_checkpoints import GEMMA2_WINDOW, GEMMA3_WINDOW, write_gemma_checkpoint
from tests.engine.hf_oracle import load_hf
from tests.engine.sliding_window_checkpoints import WindowBound
from tokenmill import LLM, SamplingParams
from tokenmill.model.arch import SUPPORTED_ROPE_TYPES

MAX_NEW = 12
FAMILIES = ["gemma2", "gemma3"]
WINDOWS = {"gemma2": GEMMA2_WINDOW, "gemma3": GEMMA3_WINDOW}


tiny_gemma2_dir = gemma_checkpoints.tiny_gemma2_dir
tiny_gemma3_dir = gemma_checkpoints.tiny_gemma3_dir


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def gemma_dir(family, request) -> str:
    return str(request.getfixturevalue(f"tiny_{family}_dir"))


def _prompts(vocab_size: int, count: int, seed: int, min_len: int, max_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(5, vocab_size) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)
    ]


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("attention_backend", "torch")
    return LLM(path, **kwargs)


@functools.cache
def _hf_logprobs(path: str, token_ids: tuple[int, ...]) -> torch.Tensor:
    """transformers' log-softmax at every position of `token_ids`, in one forward."""
    with torch.inference_mode():
        logits = load_hf(path)(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _check_greedy(llm: LLM, path: str, prompts: list[list[int]], *, logprobs: bool = False) -> list:
    """Our greedy continuation is transformers' greedy one: at every step its argmax given the same
    tokens before (checked on prompt + our tokens in one transformers forward, not step by step);
    with `logprobs`, the chosen tokens' and the prompt tokens' logprobs within 1e-4."""
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
        logprobs=1 if logprobs else None, prompt_logprobs=1 if logprobs else None,
    )  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        tokens = completion.token_ids
        assert len(tokens) == MAX_NEW
        expected = _hf_logprobs(path, tuple(prompt + tokens))
        greedy = expected[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
        assert tokens == greedy, f"prompt of {len(prompt)} tokens diverged from transformers' greedy tokens"
        if not logprobs:
            continue
        for j, (token, position) in enumerate(zip(tokens, completion.logprobs, strict=True)):
            expected_lp = expected[len(prompt) - 1 + j, token].item()
            assert position[token].logprob == pytest.approx(expected_lp, abs=1e-4)
        for i, (token, position) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:], strict=True)):
            assert position[token].logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
    llm.engine.check_invariants()
    return outputs


def test_transformers_runs_the_attention_that_soft_caps(tiny_gemma2_dir):
    # Gemma 2 soft-caps attention logits only in transformers' eager (and flex) attention; the
    # oracle would be wrong with SDPA.
    assert load_hf(str(tiny_gemma2_dir)).config._attn_implementation == "eager"


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_concurrent_requests_with_logprobs(gemma_dir, family, backend):
    """Six prompts of 2-6 windows at once: tokens, their logprobs and the prompts' logprobs."""
    from tokenmill.kernels.cpu.build import cpu_kernels_available

    if backend == "cpu" and not cpu_kernels_available()[0]:
        pytest.skip(cpu_kernels_available()[1])
    llm = _llm(gemma_dir, attention_backend=backend, max_num_batched_tokens=64)
    window = WINDOWS[family]
    prompts = _prompts(llm.info.vocab_size, 6, seed=1, min_len=2 * window, max_len=6 * window)
    _check_greedy(llm, gemma_dir, prompts, logprobs=True)
    # The runner built the backend with the query_pre_attn_scalar's scale, not head_dim's.
    assert llm.engine.runner.attn_backend.scale == pytest.approx(24**-0.5)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_chunked_prefill_small_token_budget(gemma_dir, family, async_scheduling):
    # Chunks of 8 tokens or fewer: a window spans several chunks and steps.
    llm = _llm(gemma_dir, max_num_batched_tokens=8, max_num_seqs=4, async_scheduling=async_scheduling)
    window = WINDOWS[family]
    # Gemma's local layers form their own KV cache group(s), which keep only the window's blocks.
    bound = WindowBound(llm)
    prompts = _prompts(llm.info.vocab_size, 5, seed=2, min_len=window, max_len=4 * window)
    _check_greedy(llm, gemma_dir, prompts)
    assert bound.sliding_groups() and bound.num_checks > 0
    full = [g for g, w in enumerate(llm.engine.scheduler.kv.windows) if w is None]
    assert full, "Gemma's global layers keep a full-attention group"
    # The bound (checked after every schedule) is what the window allows; the global layers' group
    # grows with the sequence, so it held more blocks than any sliding group did.
    assert max(bound.max_live[g] for g in full) > max(bound.max_live[g] for g in bound.sliding_groups())


def test_preemption_in_a_small_kv_pool(gemma_dir, family):
    # A pool of one max_model_len sequence's K/V (96 tokens, 1 KiB a token: 4 layers x K and V x 2
    # heads x 16 x fp32) in blocks of 4, and 16-token steps: prefills admitted chunk by chunk, 8
    # requests growing to 42-72 tokens cannot all stay resident. Given in bytes, the pool keeps its
    # size when the sliding layers' blocks are kept apart and freed behind the window (the kvg
    # branch's KV cache groups), and preemption still happens then (checked on a trial merge).
    llm = _llm(
        gemma_dir, kv_cache_memory=96 * 1024, block_size=4, max_model_len=96, max_num_batched_tokens=16
    )
    window = WINDOWS[family]
    _check_greedy(llm, gemma_dir, _prompts(llm.info.vocab_size, 8, seed=3, min_len=30, max_len=60))
    assert llm.engine.get_stats()["num_preemptions_total"] > 0
    assert window < 30  # the prompts outgrow every sliding window


def test_prefix_caching_reuses_a_prefix_longer_than_the_window(gemma_dir, family):
    llm = _llm(gemma_dir, enable_prefix_caching=True, block_size=4)
    shared = _prompts(llm.info.vocab_size, 1, seed=4, min_len=64, max_len=64)[0]  # 4 / 2.7 windows
    tails = _prompts(llm.info.vocab_size, 4, seed=5, min_len=1, max_len=8)
    prompts = [shared + tail for tail in tails]
    _check_greedy(llm, gemma_dir, prompts[:1])  # caches the shared prefix
    outputs = _check_greedy(llm, gemma_dir, prompts[1:])
    assert all(out.num_cached_tokens >= 64 for out in outputs)


def test_gemma3_conditional_generation_checkpoint_serves_its_text_model(tmp_path, tiny_tokenizer):
    """A Gemma3ForConditionalGeneration checkpoint (text weights under language_model.*, a vision
    tower beside them): the text model loads, the vision weights are skipped, and text generation
    equals transformers' multimodal model on text-only input."""
    path = str(write_gemma_checkpoint(tmp_path / "gemma3_mm", "gemma3-multimodal", tiny_tokenizer, seed=13))
    llm = _llm(path)
    assert llm.engine.runner.arch.architecture == "gemma3"
    assert llm.engine.runner.model.num_skipped_vision_weights > 0
    assert type(load_hf(path)).__name__ == "Gemma3ForConditionalGeneration"
    prompts = _prompts(llm.info.vocab_size, 3, seed=6, min_len=30, max_len=70)
    _check_greedy(llm, path, prompts, logprobs=True)


@pytest.mark.skipif(
    "linear" not in SUPPORTED_ROPE_TYPES, reason="linear RoPE scaling comes with the phi branch (rotary.py)"
)
def test_gemma3_linear_rope_scaling_on_its_global_layers(tmp_path, tiny_tokenizer):
    """Gemma 3 (4B and up) scales the global layers' RoPE linearly (factor 8 there, 4 here) and
    leaves the local table alone: each layer rotates with its own."""
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
    }
    path = write_gemma_checkpoint(tmp_path / "g3", "gemma3", tiny_tokenizer, seed=14, rope_parameters=rope)
    path = str(path)
    llm = _llm(path)
    arch = llm.engine.runner.arch
    assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "linear"
    assert arch.local_rope_scaling is None
    _check_greedy(llm, path, _prompts(llm.info.vocab_size, 3, seed=7, min_len=40, max_len=120), logprobs=True)
