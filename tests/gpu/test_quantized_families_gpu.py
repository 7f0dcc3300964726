"""Quantized Gemma 3 and Phi-3 (fused tensors split into merged parts) on a CUDA GPU through the
FP8 / INT4 kernels and CUDA graphs, in bf16 against transformers' bf16 on the dequantized weights,
as test_quantized_gpu.py holds Llama (the CPU tests hold them to transformers exactly:
tests/engine/test_quantized_families.py). FP8 runs its 16-bit-activation paths here (chunks of at
most 64 rows), so transformers needs no fake activation quantization."""

from __future__ import annotations

import os

import pytest
import torch

from tests.gpu.test_quantized_gpu import TOLERANCES, _hf_logprobs, _prompts, _sixteen_bit_activation_paths
from tests.model import quantized_checkpoints
from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.linear import linear_layers
from tokenmill.model.layers.quantized_method import QuantizedLinearMethod

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="TRITON_INTERPRET=1 in this process"),
]

quantized_checkpoint = quantized_checkpoints.quantized_checkpoint  # the session fixture


@pytest.mark.parametrize(
    ("source", "layout"),
    [("gemma3", "ct-fp8-channel"), ("gemma3", "awq-g128"), ("phi3", "hf-fp8-block"), ("phi3", "gptq-g32-sym-actorder")],
)
def test_bf16_quantized_family_tracks_transformers(quantized_checkpoint, source, layout, monkeypatch):
    _sixteen_bit_activation_paths(monkeypatch)
    max_tol, mean_tol, margin_tol = TOLERANCES["fp8-a16" if "fp8" in layout else "int4"]
    ckpt = quantized_checkpoint(layout, source=source)
    llm = LLM(str(ckpt.path), device="cuda", max_model_len=256, num_kv_blocks=128, max_num_batched_tokens=64)
    assert any(isinstance(layer.method, QuantizedLinearMethod) for layer in linear_layers(llm.engine.runner.model))
    prompts = _prompts(llm.info.vocab_size, 4, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    diffs = []
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params), strict=True):
        expected = _hf_logprobs(str(ckpt.reference), prompt)
        for i, pos in enumerate(out.prompt_logprobs[1:]):
            diffs.append(abs(pos[prompt[i + 1]].logprob - expected[i, prompt[i + 1]].item()))
        completion = out.outputs[0].token_ids
        forced = _hf_logprobs(str(ckpt.reference), prompt + completion)[len(prompt) - 1 : -1]
        for step, token in enumerate(completion):
            top2 = forced[step].topk(2)
            if token != int(top2.indices[0]):
                margin = float(top2.values[0] - top2.values[1])
                assert margin < margin_tol, f"greedy token {step} left transformers' argmax at margin {margin:.3f}"
                break
    assert max(diffs) < max_tol and sum(diffs) / len(diffs) < mean_tol, (max(diffs), sum(diffs) / len(diffs))
    llm.engine.check_invariants()
