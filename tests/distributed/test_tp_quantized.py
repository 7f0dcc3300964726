"""FP8 quantized at load (`--quantization fp8`) under tensor parallelism (gloo, two ranks): each rank
quantizes its shard, and a row-parallel shard's per-channel scales come from the whole row's absmax,
so the ranks hold exactly the one-rank model's FP8 values: greedy tokens equal the one-process FP8
engine's, and their logprobs agree to float rounding (per-shard scales would move them by ~0.1)."""

from __future__ import annotations

import pytest

from tests.distributed.conftest import SMALL_ENGINE
from tokenmill import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 61)), [300, 17, 42]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def _greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)])
        for o in outputs
    ]


def test_fp8_at_load_equals_one_rank(tp_qwen2_dir):
    path = str(tp_qwen2_dir)
    one = _greedy(LLM(path, quantization="fp8", **SMALL_ENGINE))
    assert [t for t, _ in one] != [t for t, _ in _greedy(LLM(path, **SMALL_ENGINE))], "FP8 changed nothing"
    two = LLM(path, quantization="fp8", tensor_parallel_size=2, **SMALL_ENGINE)
    try:
        got = _greedy(two)
        two.engine.check_invariants()
    finally:
        two.shutdown()
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, one, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
