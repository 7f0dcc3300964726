"""Quantized checkpoints in every published layout, and 16-bit weights quantized at load, against
transformers on the dequantized weights (the CPU's reference path multiplies with exactly those):
greedy tokens equal and logprobs close in fp32, alone and batched with chunked prefill; bad
checkpoints fail naming the tensor; a quantized engine leaves no KV block behind."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.hf_oracle import hf_greedy
from tests.model.quantized_checkpoints import (
    FP8_LAYOUTS,
    INT4_LAYOUTS,
    corrupt_tensor,
    quantized_checkpoint,  # noqa: F401  (a fixture)
)
from tokenmill import LLM, SamplingParams
from tokenmill.config import KernelConfig, ModelConfig
from tokenmill.model.layers.fp8_linear import Fp8LinearMethod
from tokenmill.model.layers.int4_linear import Int4LinearMethod
from tokenmill.model.layers.linear import linear_layers
from tokenmill.model.layers.quantize_weights import dequantize_fp8, dequantize_int4, quantize_fp8_per_channel
from tokenmill.model.layers.quantize_weights import quantize_int4
from tokenmill.model.registry import load_model, resolve_model
from tokenmill.attention.torch_ref import TorchAttentionBackend

MAX_NEW = 8


def _prompts(vocab: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def _greedy(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _check(llm: LLM, reference: str, prompts: list[list[int]]) -> None:
    for prompt, out in zip(prompts, _greedy(llm, prompts), strict=True):
        expected, expected_lp = hf_greedy(reference, prompt, MAX_NEW)
        completion = out.outputs[0]
        assert completion.token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
        got_lp = [next(iter(step.values())).logprob for step in completion.logprobs]
        assert got_lp == pytest.approx(expected_lp, abs=1e-4)
    llm.engine.check_invariants()


@pytest.mark.parametrize("layout", FP8_LAYOUTS + INT4_LAYOUTS)
def test_quantized_checkpoint_matches_transformers_on_its_dequantized_weights(quantized_checkpoint, layout):
    ckpt = quantized_checkpoint(layout)
    llm = LLM(str(ckpt.path), device="cpu", max_model_len=128)
    methods = {type(layer.method) for layer in linear_layers(llm.engine.model_runner.model)}
    expected = Fp8LinearMethod if "fp8" in layout else Int4LinearMethod
    assert expected in methods  # quantized layers (and lm_head 16-bit beside them)
    _check(llm, str(ckpt.reference), _prompts(llm.engine.vocab_size, 3, seed=len(layout)))


@pytest.mark.parametrize("layout", ["ct-fp8-block", "gptq-g32-sym-actorder"])
def test_batched_with_chunked_prefill_and_a_bf16_source(quantized_checkpoint, layout):
    ckpt = quantized_checkpoint(layout, source="llama-bf16")
    llm = LLM(str(ckpt.path), device="cpu", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=3)
    _check(llm, str(ckpt.reference), _prompts(llm.engine.vocab_size, 5, seed=7))


def _at_load_reference(tmp_path, source_dir, method: str):
    """The source checkpoint with every projection replaced by its at-load quantization's
    dequantized weights (quantized here with the same quantizers), for transformers."""
    from safetensors.torch import load_file, save_file

    from tests.model.quantized_checkpoints import QUANTIZED_PROJECTIONS, _copy_side_files

    out = tmp_path / f"ref-{method}"
    out.mkdir()
    _copy_side_files(source_dir, out)
    tensors = load_file(str(source_dir / "model.safetensors"))
    for name, tensor in tensors.items():
        if name.rpartition(".")[0].rpartition(".")[2] in QUANTIZED_PROJECTIONS and name.endswith(".weight"):
            w = tensor.float()
            if method == "fp8":
                tensors[name] = dequantize_fp8(*quantize_fp8_per_channel(w))
            else:
                q = quantize_int4(w, 128 if w.shape[1] % 128 == 0 else 64, symmetric=method == "gptq",
                                  scale_dtype=torch.float32)  # fmt: skip
                tensors[name] = dequantize_int4(q.q, q.scales, q.zeros, q.group_size, q.g_idx)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((source_dir / "config.json").read_text())
    return out


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_quantized_at_load_matches_the_dequantized_reference(tmp_path, quantized_checkpoint, method):
    source = quantized_checkpoint("ct-fp8-channel").path.parent.parent  # the session's llama source
    source_dir = next(p for p in source.parent.iterdir() if p.name.startswith("src-llama") and
                      not p.name.startswith("src-llama-bf16"))  # fmt: skip
    reference = _at_load_reference(tmp_path, source_dir, method)
    llm = LLM(str(source_dir), device="cpu", max_model_len=128, quantization=method)
    _check(llm, str(reference), _prompts(llm.engine.vocab_size, 3, seed=3))


def test_greedy_output_unchanged_without_quantization(tiny_llama_dir):
    """No --quantization: the 16-bit methods, exactly as before (no quantized method anywhere)."""
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128)
    assert not any(
        isinstance(layer.method, (Fp8LinearMethod, Int4LinearMethod))
        for layer in linear_layers(llm.engine.model_runner.model)
    )
    _check(llm, str(tiny_llama_dir), _prompts(llm.engine.vocab_size, 2, seed=1))


@pytest.mark.parametrize(
    ("layout", "tensor", "bad_shape"),
    [
        ("ct-fp8-channel", "model.layers.0.self_attn.k_proj.weight_scale", (3, 1)),
        ("ct-fp8-block", "model.layers.1.mlp.down_proj.weight_scale", (1, 1)),
        ("awq-g128", "model.layers.0.mlp.up_proj.qzeros", (1, 3)),
        ("gptq-g128-sym", "model.layers.1.self_attn.o_proj.scales", (2, 5)),
    ],
)
def test_a_tensor_disagreeing_with_the_config_is_named(tmp_path, quantized_checkpoint, layout, tensor, bad_shape):
    ckpt = quantized_checkpoint(layout)
    broken = corrupt_tensor(ckpt.path, tmp_path / "broken", tensor, bad_shape)
    resolved = resolve_model(ModelConfig(model=str(broken)))
    with pytest.raises(ValueError, match=tensor.replace(".", r"\.")) as err:
        load_model(ModelConfig(model=str(broken)), resolved.arch, "cpu", torch.float32, TorchAttentionBackend(),
                   resolved=resolved, kernel=KernelConfig())  # fmt: skip
    assert "shape" in str(err.value)
