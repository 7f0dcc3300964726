"""Tensor parallelism beyond the dense Llama decoder: Gemma 2 / Gemma 3, the mixture-of-experts
decoders (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE) and Phi-3 at tensor_parallel_size=2
on the CPU (gloo) give transformers' fp32 greedy tokens on tiny checkpoints.

The checkpoints are the families' CPU-test ones (tests/engine/gemma_checkpoints.py,
tests/moe_checkpoints.py, tests/engine/rope_window_checkpoints.py): 4 query / 2 KV heads (one KV
head per rank), every intermediate size even. Gemma 2 has a vocabulary of 1001 (padding rows on the
second rank, under the soft-capped, tied lm_head). Prompts of 41 and 35 tokens span several of
Gemma's sliding windows (16 / 24) and take Phi-3's long LongRoPE factors (past 32 positions).
"""

from __future__ import annotations

import pytest

from tests import moe_checkpoints
from tests.distributed.conftest import SMALL_ENGINE
from tests.distributed.test_tensor_parallel import assert_greedy_equals_hf

# The MoE checkpoints are session fixtures shared with the one-process MoE tests.
tiny_mixtral_dir = moe_checkpoints.tiny_mixtral_dir
tiny_qwen2_moe_dir = moe_checkpoints.tiny_qwen2_moe_dir
tiny_qwen3_moe_dir = moe_checkpoints.tiny_qwen3_moe_dir

PROMPTS = [list(range(20, 61)), [300, 17, 42, *range(500, 532)]]
CHECKPOINTS = [
    "tp_gemma2_dir",
    "tp_gemma3_dir",
    "tiny_mixtral_dir",
    "tiny_qwen2_moe_dir",
    "tiny_qwen3_moe_dir",
    "tp_phi3_dir",
]


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_two_ranks_equal_transformers(request, checkpoint):
    from tokenmill import LLM

    path = str(request.getfixturevalue(checkpoint))
    llm = LLM(path, tensor_parallel_size=2, **SMALL_ENGINE)
    try:
        assert type(llm.engine.executor).__name__ == "MultiprocExecutor"
        assert_greedy_equals_hf(llm, path, PROMPTS)
    finally:
        llm.shutdown()
