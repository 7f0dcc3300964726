"""Serving compiles no Triton kernel once the engine has started: the start-up warm-up
(worker/kernel_warmup.py), the memory profile and the CUDA-graph capture have launched every
kernel variant a realistic workload needs. A compile inside a step stalls every request in it
(0.5-1.2 s each for the paged attention kernel with a cold Triton cache).

The model has Llama-3.1-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128: tiles
and split counts depend on them) on two small layers, in bf16.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import write_tiny_checkpoint
from tokenmill import LLM
from tokenmill.bench.mixed_workload import run_mixed_workload
from tokenmill.kernels.jit_compiles import JitCompiles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"
    ),
]


@pytest.fixture(scope="module")
def llama_8b_attention_dir(tmp_path_factory, tiny_tokenizer):
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("llama_8b_attention"),
        "llama",
        tiny_tokenizer,
        seed=3,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
    )


def test_a_mixed_workload_after_start_up_compiles_no_triton_kernel(llama_8b_attention_dir, monkeypatch):
    llm = LLM(
        str(llama_8b_attention_dir),
        device="cuda",
        dtype="bfloat16",
        max_model_len=4096,
        max_num_seqs=64,
        num_kv_blocks=4096,
    )
    runner = llm.engine.runner
    shapes = []  # (decode-only, requests, decodes, longest chunk, longest sequence) of each step
    real_build_metadata = runner.build_metadata

    def build_metadata(batch, padded_reqs=None, **kwargs):
        if padded_reqs is None:  # not a whole-step graph's replay
            lens = batch.query_start_loc[1:] - batch.query_start_loc[:-1]
            decodes = int((lens == 1).sum())
            shapes.append((batch.max_query_len == 1, len(lens), decodes, batch.max_query_len, batch.max_seq_len))
        return real_build_metadata(batch, padded_reqs, **kwargs)

    monkeypatch.setattr(runner, "build_metadata", build_metadata)
    compiles = JitCompiles()  # after start-up: only what serving compiles
    assert compiles.installed
    try:
        steps = run_mixed_workload(llm)
        found = compiles.drain()
    finally:
        compiles.close()
    assert not found, "compiled while serving: " + ", ".join(f"{name} ({s:.2f} s)" for name, _, s in found)
    # The workload had what it is meant to: mixed steps of a 512-token chunk with 30+ decodes at
    # ~600-token contexts (split-KV), short chunks, decode-only steps of one request that no
    # whole-step graph takes (the lone prompts), besides the graph replays.
    assert steps > 150 and runner.graph_runner.num_replays > 100
    assert any(not d and n >= 30 and q >= 512 and s >= 512 for d, _, n, q, s in shapes)
    assert any(not d and q <= 16 for d, *_, q, _ in shapes)
    assert any(d and r == 1 for d, r, *_ in shapes)


def test_constrained_steps_after_start_up_compile_no_triton_kernel(llama_8b_attention_dir):
    """The grammar mask kernel (xgrammar's, launched by GrammarMasker) is warmed for every row-count
    variant: 1, 2-15 and 16+ constrained rows in a step compile nothing while serving."""
    pytest.importorskip("xgrammar")
    from tokenmill import SamplingParams
    from tokenmill.sampling_params import StructuredOutputsParams

    llm = LLM(str(llama_8b_attention_dir), device="cuda", dtype="bfloat16", max_model_len=512, max_num_seqs=64)
    choice = StructuredOutputsParams(choice=["red", "green", "blue"])
    compiles = JitCompiles()
    assert compiles.installed
    try:
        for batch in (1, 5, 32):
            params = SamplingParams(temperature=1.0, seed=batch, max_tokens=6, structured_outputs=choice)
            outputs = llm.generate([f"colour {i}:" for i in range(batch)], params)
            assert all(o.outputs[0].text in {"red", "green", "blue"} for o in outputs)
        found = compiles.drain()
    finally:
        compiles.close()
    assert not found, "compiled while serving: " + ", ".join(f"{name} ({s:.2f} s)" for name, _, s in found)
