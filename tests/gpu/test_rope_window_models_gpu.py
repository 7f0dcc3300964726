"""Phi-3 (LongRoPE with partial rotary; sliding window) and Mistral with its sliding window on CUDA
in bf16: the first greedy tokens equal transformers' bf16 on the GPU up to a tie at bf16
precision, and the chosen tokens' logprobs stay close (the same oracle as test_engine_gpu.py's
bf16 test). Sliding-window prompts span several windows of 32."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tests.engine.rope_window_checkpoints import SPECS, write_checkpoint
from tests.gpu.test_engine_gpu import (
    _bf16_logprob_diffs_allowing_ties,
    _greedy,
    _hf_greedy_bf16_with_ties,
    _llm,
    _prompts,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]

MAX_NEW = 24


@pytest.mark.parametrize("name", ["phi3_longrope_long_partial", "phi3_sliding", "mistral_sliding"])
def test_bf16_greedy_and_logprobs_match_transformers(name, tmp_path, tiny_tokenizer):
    path = str(write_checkpoint(tmp_path, name, tiny_tokenizer, seed=50))
    _, _, max_model_len, min_len = SPECS[name]
    llm = _llm(path, max_model_len=max_model_len)  # dtype auto = bfloat16 on CUDA
    assert llm.info.dtype == "bfloat16"
    # Tiny random models in bf16 often tie their two best logits; a tie in the first steps ends the
    # comparison before it says anything. Keep the first 4 candidate prompts on which transformers'
    # bf16 has no tie in its first 4 steps (the rest of the sequence may still tie, as allowed).
    candidates = _prompts(
        llm.info.vocab_size, 24, seed=51, min_len=max(min_len, 8), max_len=max(min_len, 8) + 40
    )
    prompts = [p for p in candidates if not any(_hf_greedy_bf16_with_ties(path, p, MAX_NEW)[3][:4])][:4]
    assert len(prompts) == 4, f"only {len(prompts)} of {len(candidates)} prompts start without a bf16 tie"
    diffs = []
    for prompt, completion in zip(prompts, _greedy(llm, prompts, MAX_NEW, logprobs=0), strict=True):
        diffs += _bf16_logprob_diffs_allowing_ties(path, prompt, completion, MAX_NEW)
    assert max(diffs) < 0.1 and sum(diffs) / len(diffs) < 0.02, (max(diffs), sum(diffs) / len(diffs))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
