"""Piecewise CUDA graphs (worker/piecewise_graphs.py): steps with prefill chunks replay graphs
captured between attention calls, and their greedy output still equals transformers'.

A small step budget makes every request's prompt arrive in chunks beside other requests' decodes,
so the mixed steps (the ones the pieces exist for) dominate.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests import moe_checkpoints
from tests.engine import gemma_checkpoints
from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]


tiny_mixtral_dir = moe_checkpoints.tiny_mixtral_dir
tiny_qwen3_moe_dir = moe_checkpoints.tiny_qwen3_moe_dir


tiny_gemma2_dir = gemma_checkpoints.tiny_gemma2_dir
tiny_gemma3_dir = gemma_checkpoints.tiny_gemma3_dir


def _prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab_size) for _ in range(rng.randint(3, 90))] for _ in range(count)]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(
        path, device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=512, max_num_seqs=32,
        max_num_batched_tokens=48, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    "model",
    # Dense, Q/K norms, mixture-of-experts (grouped GEMMs and routing inside the pieces), and
    # Gemma's sliding-window layers, soft caps and per-layer RoPE tables.
    ["tiny_llama_dir", "tiny_qwen3_dir", "tiny_mixtral_dir", "tiny_qwen3_moe_dir", "tiny_gemma2_dir", "tiny_gemma3_dir"],
)
def test_mixed_steps_in_piecewise_graphs_match_transformers(model, request):
    path = str(request.getfixturevalue(model))
    llm = _llm(path)
    pieces = llm.engine.runner.piecewise
    assert pieces is not None and pieces.captured, "no piecewise graphs were captured"
    prompts = _prompts(llm.info.vocab_size, 12, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert pieces.num_replays > 0, "no step went through the piecewise graphs"
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)[0], f"{len(prompt)}-token prompt"
    llm.engine.check_invariants()


def test_piecewise_graphs_off_runs_eagerly_with_the_same_tokens(tiny_llama_dir):
    path = str(tiny_llama_dir)
    prompts = _prompts(1000, 8, seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    on = _llm(path)
    with_pieces = [o.outputs[0].token_ids for o in on.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert on.engine.runner.piecewise.num_replays > 0
    del on
    off = _llm(path, kernel_config={"piecewise_cuda_graphs": False})
    assert off.engine.runner.piecewise is None
    eager = [o.outputs[0].token_ids for o in off.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert with_pieces == eager

