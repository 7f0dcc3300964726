"""Tensor parallelism over NCCL on several CUDA GPUs (one worker process per GPU): fp32 greedy
tokens equal transformers' (on the CPU), eagerly and with CUDA graphs capturing the all-reduces; a
killed rank ends the engine with an error naming it, and no worker outlives it.

Also every other family that shards (Gemma 2/3, Mixtral, Qwen2/3-MoE, Phi-3, gpt-oss) at TP=2 on the
checkpoints of its CPU test. Needs at least 2 GPUs (4 for the TP=4 cases); skipped otherwise. The CPU (gloo) twin of this file is
tests/distributed/test_tensor_parallel.py; benchmarks/multi_gpu.sh runs this file on several-GPU
machines, with bf16 agreement against TP=1 at 8B shapes beside it (benchmarks/tp_agreement.py).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests import gpt_oss_checkpoint, moe_checkpoints
from tests.conftest import write_tiny_checkpoint
from tests.distributed import conftest as tp_checkpoints
from tests.distributed.test_tp_families import CHECKPOINTS as FAMILY_CHECKPOINTS
from tests.distributed.test_tp_families import PROMPTS as FAMILY_PROMPTS
from tests.distributed.test_tp_speculative import PROMPTS as REPEATING_PROMPTS
from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.errors import EngineDeadError

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# The other families' CPU-test checkpoints (tests/distributed/test_tp_families.py), as fixtures here.
tiny_mixtral_dir = moe_checkpoints.tiny_mixtral_dir
tiny_qwen2_moe_dir = moe_checkpoints.tiny_qwen2_moe_dir
tiny_qwen3_moe_dir = moe_checkpoints.tiny_qwen3_moe_dir
tiny_gpt_oss_dir = gpt_oss_checkpoint.tiny_gpt_oss_dir
tp_gemma2_dir = tp_checkpoints.tp_gemma2_dir
tp_gemma3_dir = tp_checkpoints.tp_gemma3_dir
tp_phi3_dir = tp_checkpoints.tp_phi3_dir
tp_qwen2_dir = tp_checkpoints.tp_qwen2_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA devices"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]

MAX_NEW = 12
# 8 query heads: 2 and 4 ranks split them. vocab 1001: both need padding rows on the last rank.
SHAPES = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 8, "head_dim": 16,
          "vocab_size": 1001}  # fmt: skip


@pytest.fixture(scope="module")
def gqa_llama_dir(tmp_path_factory, tiny_tokenizer):
    """4 KV heads: split at TP=2 and TP=4."""
    return str(write_tiny_checkpoint(
        tmp_path_factory.mktemp("tp_gpu_llama"), "llama", tiny_tokenizer, seed=21, num_key_value_heads=4,
        **SHAPES,
    ))  # fmt: skip


@pytest.fixture(scope="module")
def mqa_qwen2_dir(tmp_path_factory, tiny_tokenizer):
    """q/k/v biases and one KV head (replicated on every rank)."""
    return str(write_tiny_checkpoint(
        tmp_path_factory.mktemp("tp_gpu_qwen2"), "qwen2", tiny_tokenizer, seed=22, num_key_value_heads=1,
        **SHAPES,
    ))  # fmt: skip


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(rng.randint(3, 60))] for _ in range(count)]


def _tp_llm(path: str, size: int, **kwargs) -> LLM:
    return LLM(
        path, device="cuda", dtype="float32", tensor_parallel_size=size, max_model_len=256,
        num_kv_blocks=256, max_num_seqs=32, **kwargs,
    )  # fmt: skip


def _assert_greedy_equals_hf(llm: LLM, path: str, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, MAX_NEW)[0], f"prompt {i} ({len(prompt)} tokens)"


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("checkpoint", ["gqa_llama_dir", "mqa_qwen2_dir"])
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_greedy_equals_transformers(request, checkpoint, size, enforce_eager):
    if size > NUM_GPUS:
        pytest.skip(f"needs {size} CUDA devices, {NUM_GPUS} here")
    path = request.getfixturevalue(checkpoint)
    llm = _tp_llm(path, size, enforce_eager=enforce_eager)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        _assert_greedy_equals_hf(llm, path, _prompts(3, seed=1))  # 3 requests: the graph of padded size 4
        _assert_greedy_equals_hf(llm, path, _prompts(16, seed=2))  # 16 concurrent: batched decode graphs
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


def test_nccl_only_all_reduces_equal_transformers(gqa_llama_dir):
    """--disable-custom-all-reduce: every all-reduce through NCCL (the other tests run the default,
    the one-shot symmetric-memory kernel for the small ones), in and out of CUDA graphs."""
    llm = _tp_llm(gqa_llama_dir, 2, disable_custom_all_reduce=True)
    try:
        _assert_greedy_equals_hf(llm, gqa_llama_dir, _prompts(16, seed=4))
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("checkpoint", FAMILY_CHECKPOINTS)
def test_other_families_on_two_gpus_equal_transformers(request, checkpoint):
    """Gemma 2/3, the MoE decoders (the fused Triton MoE path with each expert's columns split),
    Phi-3 and gpt-oss at TP=2 with CUDA graphs: fp32 greedy tokens equal transformers'."""
    path = str(request.getfixturevalue(checkpoint))
    llm = _tp_llm(path, 2)
    try:
        _assert_greedy_equals_hf(llm, path, FAMILY_PROMPTS)
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


def test_ngram_speculation_on_two_gpus_equals_transformers(request):
    """Verification steps (CUDA graphs of 1 + k rows per request) on every rank, rank 0's accepted
    runs broadcast over NCCL: greedy tokens equal transformers', with drafts accepted."""
    path = str(request.getfixturevalue("tp_qwen2_dir"))
    llm = _tp_llm(path, 2, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        _assert_greedy_equals_hf(llm, path, REPEATING_PROMPTS)
        stats = llm.engine.get_stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0, "no draft accepted: the test proves nothing"
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


def test_killed_rank_is_named_and_no_worker_outlives_the_engine(gqa_llama_dir):
    llm = _tp_llm(gqa_llama_dir, 2)
    workers = llm.engine.executor._processes
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate({"prompt_token_ids": [5, 6, 7]}, params)[0].outputs[0].token_ids) == 4
        workers[1].kill()
        with pytest.raises(EngineDeadError, match=rf"rank 1 \(pid {workers[1].pid}\) exited"):
            llm.generate([{"prompt_token_ids": p} for p in _prompts(4, seed=3)], params)
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in workers), "workers outlived shutdown"
