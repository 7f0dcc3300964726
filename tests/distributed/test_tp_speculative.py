"""ngram speculative decoding under tensor parallelism (gloo, two ranks): the proposer runs on each
rank's host from the tokens every rank holds, verification runs on every rank and rank 0's accepted
runs are broadcast; greedy output equals transformers' (and so speculation off) token for token."""

from __future__ import annotations

from tests.distributed.conftest import SMALL_ENGINE
from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams

MAX_NEW = 8
# Prompts on which this tiny random checkpoint repeats itself (814 x 7, 865 x 3, 482 433 482 433):
# n-gram drafts get accepted, so accepted runs of several tokens cross the broadcast.
PROMPTS = [[637] * 6, [978] * 6, [243] * 5 + [17]]


def test_ngram_greedy_equals_speculation_off(tp_qwen2_dir):
    path = str(tp_qwen2_dir)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(path, tensor_parallel_size=2, speculative_config=spec, **SMALL_ENGINE)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for prompt, out in zip(PROMPTS, outputs, strict=True):
            assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0]
        stats = llm.engine.get_stats()
        assert stats["spec_decode_num_drafts"] > 0, "no draft was verified: the test proves nothing"
        assert stats["spec_decode_num_accepted_tokens"] > 0
        # A seeded sampled request verifies drafts through the rejection sampler on every rank and
        # takes rank 0's result: it repeats itself exactly.
        seeded = SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_NEW, ignore_eos=True)
        first, again = (llm.generate({"prompt_token_ids": PROMPTS[0]}, seeded)[0].outputs[0].token_ids for _ in range(2))
        assert first == again and len(first) == MAX_NEW
        llm.engine.check_invariants()
        assert llm.engine.get_stats()["kv_cache_usage"] == 0.0
    finally:
        llm.shutdown()
