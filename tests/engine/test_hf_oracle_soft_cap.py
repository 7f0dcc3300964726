"""The transformers oracle applies Gemma 2's attention soft cap.

Only transformers' eager attention applies `attn_logit_softcapping`; a transformers release that
loads Gemma 2 with SDPA by default drops the cap without a word. That happened on the H100
machine: tests/gpu/test_gemma_gpu.py compared our (capped) Gemma 2 against an uncapped oracle and
failed at greedy token 5 of its single-request prompt. The oracle now asks for eager attention
(hf_load_kwargs) and refuses a model that runs anything else (check_hf_applies_soft_cap).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.gemma_checkpoints import write_gemma_checkpoint
from tests.engine.hf_oracle import check_hf_applies_soft_cap, hf_greedy, hf_load_kwargs, load_hf


@pytest.fixture(scope="module")
def gpu_tests_gemma2_dir(tmp_path_factory, tiny_tokenizer) -> str:
    """tests/gpu/test_gemma_gpu.py's Gemma 2 checkpoint (final cap 30)."""
    path = tmp_path_factory.mktemp("g2_cap30")
    return str(write_gemma_checkpoint(path, "gemma2", tiny_tokenizer, seed=11, final_logit_softcapping=30.0))


def _gpu_tests_prompt(vocab_size: int) -> list[int]:
    rng = random.Random(21)  # tests/gpu/test_gemma_gpu.py's _prompts(vocab, 1, seed=21)
    return [rng.randrange(5, vocab_size) for _ in range(rng.randint(20, 90))]


def test_oracle_runs_eager_attention_for_soft_capped_models(gpu_tests_gemma2_dir, tmp_path, tiny_tokenizer):
    assert hf_load_kwargs(gpu_tests_gemma2_dir) == {"attn_implementation": "eager"}
    assert load_hf(gpu_tests_gemma2_dir).config._attn_implementation == "eager"
    gemma3 = write_gemma_checkpoint(tmp_path / "g3", "gemma3", tiny_tokenizer, seed=12)
    assert hf_load_kwargs(str(gemma3)) == {}  # no soft cap: transformers' default attention is fine


def test_check_refuses_an_attention_that_drops_the_cap(gpu_tests_gemma2_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gpu_tests_gemma2_dir, dtype=torch.float32, attn_implementation="eager")
    check_hf_applies_soft_cap(model)
    model.config._attn_implementation_internal = "sdpa"  # what a transformers defaulting to SDPA loads
    with pytest.raises(AssertionError, match="attn_logit_softcapping=1.0"):
        check_hf_applies_soft_cap(model)


def test_the_gpu_tests_prompt_tells_a_capped_oracle_from_an_uncapped_one(gpu_tests_gemma2_dir):
    """Without the attention cap, transformers' greedy tokens on the GPU test's prompt differ (at
    token 5): that test would catch an oracle that drops the cap again, and did."""
    from transformers import AutoConfig, AutoModelForCausalLM

    capped = load_hf(gpu_tests_gemma2_dir)
    prompt = _gpu_tests_prompt(capped.config.vocab_size)
    config = AutoConfig.from_pretrained(gpu_tests_gemma2_dir, attn_logit_softcapping=None)
    uncapped = AutoModelForCausalLM.from_pretrained(gpu_tests_gemma2_dir, config=config, dtype=torch.float32).eval()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        for _ in range(16):
            ids = torch.cat([ids, uncapped(ids).logits[:, -1:].argmax(-1)], dim=1)
    uncapped_tokens = ids[0, len(prompt) :].tolist()
    capped_tokens = hf_greedy(gpu_tests_gemma2_dir, prompt, 16)[0]
    assert capped_tokens[:5] == uncapped_tokens[:5]
    assert capped_tokens[5] != uncapped_tokens[5]
