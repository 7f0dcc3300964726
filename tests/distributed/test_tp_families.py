"""Tensor parallelism beyond the dense Llama decoder: Gemma 2 / Gemma 3, the mixture-of-experts
decoders (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE, gpt-oss with its sinks and biased
experts) and Phi-3 at tensor_parallel_size=2
on the CPU (gloo) give transformers' fp32 greedy tokens, and their logprobs, on tiny checkpoints.

The checkpoints are the families' CPU-test ones (tests/engine/gemma_checkpoints.py,
tests/moe_checkpoints.py, tests/gpt_oss_checkpoint.py, tests/engine/rope_window_checkpoints.py): 4 query / 2 KV heads (one KV
head per rank), every intermediate size even. Gemma 2 has a vocabulary of 1001 (padding rows on the
second rank, under the soft-capped, tied lm_head). Prompts of 41 and 35 tokens span several of
Gemma's sliding windows (16 / 24) and take Phi-3's long LongRoPE factors (past 32 positions).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests import gpt_oss_checkpoint, moe_checkpoints
from tests.distributed.conftest import SMALL_ENGINE
from tests.distributed.test_tensor_parallel import MAX_NEW
from tests.engine.hf_oracle import hf_greedy
from tests.moe_shards import moe_config, sharded_moe_blocks
from tokenmill import LLM, SamplingParams
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.moe import TorchMoEOps
from tokenmill.model.tensor_parallel import check_tensor_parallel

# The MoE checkpoints are session fixtures shared with the one-process MoE tests.
tiny_mixtral_dir = moe_checkpoints.tiny_mixtral_dir
tiny_qwen2_moe_dir = moe_checkpoints.tiny_qwen2_moe_dir
tiny_qwen3_moe_dir = moe_checkpoints.tiny_qwen3_moe_dir
tiny_gpt_oss_dir = gpt_oss_checkpoint.tiny_gpt_oss_dir

PROMPTS = [list(range(20, 61)), [300, 17, 42, *range(500, 532)]]
CHECKPOINTS = [
    "tp_gemma2_dir",
    "tp_gemma3_dir",
    "tiny_mixtral_dir",
    "tiny_qwen2_moe_dir",
    "tiny_qwen3_moe_dir",
    "tp_phi3_dir",
    "tiny_gpt_oss_dir",
]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_two_ranks_equal_transformers(request, checkpoint):
    path = str(request.getfixturevalue(checkpoint))
    llm = LLM(path, tensor_parallel_size=2, **SMALL_ENGINE)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        _assert_greedy_and_logprobs_equal_hf(llm, path)
    finally:
        llm.shutdown()


def _assert_greedy_and_logprobs_equal_hf(llm: LLM, path: str) -> None:
    """transformers' greedy tokens, and their logprobs within 1e-4: the whole logits, not only their
    argmax (Gemma 2's final soft cap never moves the argmax, only the logprobs)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        completion = out.outputs[0]
        tokens, logprobs = hf_greedy(path, prompt, MAX_NEW)
        assert completion.token_ids == tokens, f"{len(prompt)}-token prompt"
        ours = [position[token].logprob for token, position in zip(tokens, completion.logprobs, strict=True)]
        assert ours == pytest.approx(logprobs, abs=1e-4), f"{len(prompt)}-token prompt"
    llm.engine.check_invariants()


def test_moe_block_partials_sum_to_the_whole_block():
    """Each rank's block (every expert's and the shared expert's intermediate columns split, the
    router whole) returns a partial sum; in one process, where the all-reduce is the identity, the
    ranks' partials add up to the unsharded block's output. Rank 1 takes the stacked layout.
    (tests/unit/test_fused_moe_triton.py runs the same on the fused Triton kernels.)"""
    whole, ranks, x = sharded_moe_blocks(TorchMoEOps())
    assert ranks[0].experts.gate_up_proj.shape[1] == whole.experts.gate_up_proj.shape[1] // 2
    with torch.no_grad():
        expected = whole(x)
        torch.testing.assert_close(ranks[0](x) + ranks[1](x), expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(ranks[0](x), expected, atol=1e-3), "one rank alone should hold only part of it"


def test_what_the_ranks_cannot_split_evenly_is_refused_by_name():
    arch = ArchConfig(
        architecture="qwen2_moe", vocab_size=1000, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, moe=moe_config(),
    )  # fmt: skip
    check_tensor_parallel(arch, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's shared expert's"):
        check_tensor_parallel(dataclasses.replace(arch, moe=moe_config(shared_expert_intermediate_size=42)), 4)
    with pytest.raises(ValueError, match=r"does not divide the model's experts' intermediate size \(30\)"):
        check_tensor_parallel(dataclasses.replace(arch, moe=moe_config(expert_intermediate_size=30)), 4)
    # Every layer sparse: the dense MLP's size is not the model's business.
    all_sparse = dataclasses.replace(arch, intermediate_size=97, moe=moe_config(shared_expert_intermediate_size=0))
    check_tensor_parallel(all_sparse, 2)
    with pytest.raises(ValueError, match=r"does not divide the model's MLP intermediate size \(97\)"):
        check_tensor_parallel(dataclasses.replace(arch, architecture="gemma2", intermediate_size=97, moe=None), 2)
