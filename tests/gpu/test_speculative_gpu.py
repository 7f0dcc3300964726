"""Speculative decoding on a CUDA GPU: greedy output identical with it on and off (fp32, CUDA
graphs on), for ngram and a draft model; a drafter identical to the target accepts every draft."""

from __future__ import annotations

import os

import pytest
import torch

from tokenmill import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"),
]

K = 3


def _prompts(n: int, length: int = 20) -> list[list[int]]:
    return [[(7 * i + (j % 5)) % 900 + 50 for j in range(length + i)] for i in range(n)]


def _llm(path, speculative_config=None) -> LLM:
    return LLM(
        str(path), device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=256, max_num_seqs=32,
        speculative_config=speculative_config,
    )  # fmt: skip


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.engine.check_invariants()
    assert llm.engine.get_stats()["kv_cache_usage"] == 0.0
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_output_is_unchanged_on_the_gpu(tiny_llama_dir, method):
    prompts = _prompts(12)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    baseline = _llm(tiny_llama_dir)
    expected = _tokens(baseline, prompts, params)
    baseline.engine.runner.release()
    spec = {"method": method, "num_speculative_tokens": K}
    if method == "draft_model":
        spec["model"] = str(tiny_llama_dir)
    llm = _llm(tiny_llama_dir, spec)
    assert _tokens(llm, prompts, params) == expected
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    if method == "draft_model":  # the target as its own drafter
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
