"""Sliding-window KV cache groups on a CUDA GPU: the Triton backend with CUDA graphs (whose captured
metadata carries one sibling per KV cache group, refilled before each replay) against
transformers in fp32 and against the torch reference backend on the same GPU in bf16, with the
sliding groups' blocks bounded by the window after every schedule.

Checkpoints (tests/engine/sliding_window_checkpoints.py): Mistral with a 32-token window on every
layer (one sliding group) and Qwen2 with sliding layers 0 and 2 of 4 (a full and a sliding group
sharing the pool's two tensors). Needs the Triton backend to honour sliding windows.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from tests.engine.hf_oracle import hf_greedy
from tests.engine.sliding_window_checkpoints import (
    CHECKPOINTS,
    WindowBound,
    random_prompts,
    write_sliding_checkpoint,
)
from tokenmill import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]

MAX_NEW = 24


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def model_path(request, tmp_path_factory, tiny_tokenizer) -> str:
    return str(write_sliding_checkpoint(tmp_path_factory.mktemp(request.param), request.param, tiny_tokenizer))


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("device", "cuda")
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("num_kv_blocks", 128)
    kwargs.setdefault("max_num_seqs", 16)
    kwargs.setdefault("block_size", 16)
    return LLM(path, **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]], logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs)
    return [out.outputs[0] for out in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_fp32_graphs_match_transformers(model_path: str, async_scheduling: bool) -> None:
    """One request (its decode steps take the fused RoPE / deferred-norm launches) and six at
    once, prompts of 70-130 tokens: every decode step of both goes through a CUDA graph."""
    llm = _llm(model_path, dtype="float32", attention_backend="triton", async_scheduling=async_scheduling)
    bound = WindowBound(llm)
    for prompts in (
        random_prompts(llm.info.vocab_size, 1, seed=21, min_len=100, max_len=100),
        random_prompts(llm.info.vocab_size, 6, seed=22, min_len=70, max_len=130),
    ):
        for prompt, completion in zip(prompts, _greedy(llm, prompts), strict=True):
            assert completion.token_ids == hf_greedy(model_path, prompt, MAX_NEW)[0], f"{len(prompt)}-token prompt"
    graphs = llm.engine.runner.graph_runner
    assert graphs is not None and graphs.num_replays > 0, "decode steps did not go through the CUDA graphs"
    assert bound.num_checks > 0
    llm.engine.check_invariants()


def test_bf16_graphs_match_the_torch_reference_on_the_gpu(model_path: str) -> None:
    """Triton with CUDA graphs against the torch reference (eager) on the same GPU and weights in
    bf16: the same greedy tokens up to a near-tie, and close logprobs of the reference's tokens."""
    reference_llm = _llm(model_path, attention_backend="torch", enforce_eager=True)
    prompts = random_prompts(reference_llm.info.vocab_size, 4, seed=23, min_len=70, max_len=130)
    reference = _greedy(reference_llm, prompts, logprobs=2)
    del reference_llm
    gc.collect()
    llm = _llm(model_path, attention_backend="triton")
    assert llm.info.dtype == "bfloat16"
    bound = WindowBound(llm)
    ours = _greedy(llm, prompts, logprobs=2)
    assert llm.engine.runner.graph_runner is not None and llm.engine.runner.graph_runner.num_replays > 0
    diffs = []
    for expected, got in zip(reference, ours, strict=True):
        assert expected.logprobs is not None and got.logprobs is not None
        same = 0
        while same < MAX_NEW and expected.token_ids[same] == got.token_ids[same]:
            same += 1
        if same < MAX_NEW:  # a divergence is allowed only where the reference's top two nearly tie
            top2 = sorted((lp.logprob for lp in expected.logprobs[same].values()), reverse=True)[:2]
            assert len(top2) == 2 and top2[0] - top2[1] < 0.05, f"diverged at token {same}: {top2}"
        assert same >= 8, "diverged within the first 8 tokens"
        for i in range(same):
            token = expected.token_ids[i]
            diffs.append(abs(expected.logprobs[i][token].logprob - got.logprobs[i][token].logprob))
    assert max(diffs) < 0.1, max(diffs)
    assert bound.num_checks > 0
