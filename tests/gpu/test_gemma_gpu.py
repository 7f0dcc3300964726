"""Gemma 2 and Gemma 3 (text) on a CUDA GPU: the Triton ops path (Gemma's float32-weight norms in
the add + RMSNorm launch, GeGLU's gelu_tanh_mul, and for Gemma 2 the decode RoPE inside the
attention launch) against transformers, and those launches' rounding at Gemma-2-9B shapes.

fp32: greedy tokens equal transformers' (CPU) token for token, with CUDA graphs and eagerly.
bf16: the first 32 greedy tokens equal transformers' bf16 on the GPU (up to a tie at the
precision the logits carry, as tests/gpu/test_engine_gpu.py allows) and logprobs stay close.
The tiny checkpoints are tests/engine/gemma_checkpoints.py's (sliding windows of 16 and 24 tokens,
Gemma 2's attention and final soft caps), so the prompts here span several windows.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.engine.gemma_checkpoints import write_gemma_checkpoint
from tests.engine.hf_oracle import hf_greedy
from tests.gpu.test_engine_gpu import _bf16_logprob_diffs_allowing_ties, _greedy, _llm
from tests.gpu.test_engine_gpu import _prompts as _engine_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]


@pytest.fixture(scope="module")
def tiny_gemma2_dir(tmp_path_factory, tiny_tokenizer):
    # Gemma 2's own final cap (30) rather than the CPU tests' 1.5, which squeezes the logits
    # together and makes bf16 ties (see test_bf16_greedy_and_logprobs_match_transformers) common.
    path = tmp_path_factory.mktemp("tiny_gemma2")
    return write_gemma_checkpoint(path, "gemma2", tiny_tokenizer, seed=11, final_logit_softcapping=30.0)


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory, tiny_tokenizer):
    return write_gemma_checkpoint(tmp_path_factory.mktemp("tiny_gemma3"), "gemma3", tiny_tokenizer, seed=12)


@pytest.fixture(params=["tiny_gemma2_dir", "tiny_gemma3_dir"])
def gemma_dir(request) -> str:
    return str(request.getfixturevalue(request.param))


def _prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    # Longer than test_engine_gpu's default prompts: several of the tiny models' windows.
    return _engine_prompts(vocab_size, count, seed, min_len=20, max_len=90)


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_fp32_greedy_matches_transformers(gemma_dir, enforce_eager):
    llm = _llm(gemma_dir, dtype="float32", enforce_eager=enforce_eager)
    # One request alone (its decode steps are the single-request ones: Gemma 2 rotates inside the
    # attention launch there), then 8 at once.
    for prompts in (_prompts(llm.info.vocab_size, 1, seed=21), _prompts(llm.info.vocab_size, 8, seed=22)):
        for prompt, completion in zip(prompts, _greedy(llm, prompts, 16), strict=True):
            assert completion.token_ids == hf_greedy(gemma_dir, prompt, 16)[0], f"{len(prompt)}-token prompt"
    graphs = llm.engine.runner.graph_runner
    assert (graphs is None) == enforce_eager
    if graphs is not None:
        assert graphs.num_replays > 0
    assert not any(layer.norms_folded for layer in llm.engine.runner.model.layers)
    llm.engine.check_invariants()


# Prompts (one per seed) on which transformers' bf16 (on the CPU) keeps its two best logits at least
# 4 bf16 ulps apart over the first 6 tokens of both checkpoints. Random tiny models tie often at
# bf16 precision (two best logits within 2 ulps at about 1 step in 12 here), and a tie inside the
# 4 tokens _bf16_logprob_diffs_allowing_ties requires would fail on a rounding difference, not a bug.
BF16_PROMPT_SEEDS = (102, 103, 111, 114)


def test_bf16_greedy_and_logprobs_match_transformers(gemma_dir):
    llm = _llm(gemma_dir)  # dtype auto = bfloat16 on CUDA
    assert llm.info.dtype == "bfloat16"
    prompts = [_prompts(llm.info.vocab_size, 1, seed=seed)[0] for seed in BF16_PROMPT_SEEDS]
    diffs = []
    for prompt, completion in zip(prompts, _greedy(llm, prompts, 32, logprobs=0), strict=True):
        diffs += _bf16_logprob_diffs_allowing_ties(gemma_dir, prompt, completion, 32)
    # One request at a time too: single-request decode steps take their own launches.
    single = _greedy(llm, prompts[:1], 32, logprobs=0)[0]
    diffs += _bf16_logprob_diffs_allowing_ties(gemma_dir, prompts[0], single, 32)
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02, (max(diffs), sum(diffs) / len(diffs))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemma_elementwise_launches_round_like_transformers(dtype):
    """At Gemma-2-9B's widths (hidden 3584, intermediate 14336): the add + norm launch with Gemma's
    float32 weight (1 + w) rounds once, after the weight multiply, as transformers' Gemma2RMSNorm
    does; gelu_tanh_mul rounds the activation and then the product, as GELUTanh then `*` do."""
    from tokenmill.kernels.triton.elementwise import add_rms_norm, gelu_tanh_mul

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 3584, device="cuda", dtype=dtype, generator=gen)
    delta = torch.randn(37, 3584, device="cuda", dtype=dtype, generator=gen)
    w = (torch.randn(3584, device="cuda", generator=gen) * 0.3).to(dtype)
    summed = x + delta
    xf = summed.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(dtype)
    out = add_rms_norm(x, 1.0 + w.float(), 1e-6, delta, weight_in_float32=True)
    assert torch.equal(x, summed)
    one_ulp = {"rtol": 2**-7, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(out, expected, **one_ulp)
    if dtype == torch.bfloat16:  # rounded to nearest (not truncated): nearly every element bit for bit
        assert (out != expected).float().mean() < 0.01

    # (Unit-variance gates: below about -4 PyTorch's 1 + tanh cancels, and its bf16 activation
    # there is off by more than the kernel's, which computes g * sigmoid(2y).)
    gate_up = torch.randn(37, 2 * 14336, device="cuda", dtype=dtype, generator=gen)
    expected_act = torch.nn.functional.gelu(gate_up[:, :14336], approximate="tanh") * gate_up[:, 14336:]
    act = gelu_tanh_mul(gate_up)
    two_ulps = {"rtol": 2**-6, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(act, expected_act, **two_ulps)
    if dtype == torch.bfloat16:
        assert (act != expected_act).float().mean() < 0.01
