"""Quantized checkpoints in every published layout, and 16-bit weights quantized at load, against
transformers on the dequantized weights (the CPU's reference path multiplies with exactly those):
greedy tokens equal and logprobs close in fp32, alone and batched with chunked prefill; bad
checkpoints fail naming the tensor; a quantized engine leaves no KV block behind."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.hf_oracle import hf_greedy
from tests.model import quantized_checkpoints
from tests.model.quantized_checkpoints import FP8_LAYOUTS, INT4_LAYOUTS, corrupt_tensor, write_quant_source
from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.fp8_linear import Fp8LinearMethod
from tokenmill.model.layers.int4_linear import Int4LinearMethod
from tokenmill.model.layers.linear import linear_layers
from tokenmill.model.layers.quantize_weights import (
    dequantize_fp8,
    dequantize_int4,
    quantize_fp8_per_channel,
    quantize_int4,
)

MAX_NEW = 8

quantized_checkpoint = quantized_checkpoints.quantized_checkpoint  # the session fixture


@pytest.fixture(scope="module")
def llama_source(tmp_path_factory, tiny_tokenizer):
    """A tiny float32 Llama checkpoint whose layers fit 4-bit groups of 128."""
    return write_quant_source(tmp_path_factory.mktemp("at-load-src"), "llama", tiny_tokenizer)


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
    methods = {type(layer.method) for layer in linear_layers(llm.engine.runner.model)}
    expected = Fp8LinearMethod if "fp8" in layout else Int4LinearMethod
    assert expected in methods  # quantized layers (and lm_head 16-bit beside them)
    _check(llm, str(ckpt.reference), _prompts(llm.info.vocab_size, 3, seed=len(layout)))


@pytest.mark.parametrize("layout", ["ct-fp8-block", "gptq-g32-sym-actorder", "ct-w4a16-g128-sym"])
def test_batched_with_chunked_prefill_and_a_bf16_source(quantized_checkpoint, layout):
    ckpt = quantized_checkpoint(layout, source="llama-bf16")
    llm = LLM(str(ckpt.path), device="cpu", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=3)
    _check(llm, str(ckpt.reference), _prompts(llm.info.vocab_size, 5, seed=7))


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
                q = quantize_int4(w, 128, symmetric=method == "gptq", scale_dtype=torch.float32)
                tensors[name] = dequantize_int4(q.q, q.scales, q.zeros, q.group_size, q.g_idx)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((source_dir / "config.json").read_text())
    return out


@pytest.mark.parametrize("method", ["fp8", "awq", "gptq"])
def test_quantized_at_load_matches_the_dequantized_reference(tmp_path, llama_source, method):
    reference = _at_load_reference(tmp_path, llama_source, method)
    llm = LLM(str(llama_source), device="cpu", max_model_len=128, quantization=method)
    _check(llm, str(reference), _prompts(llm.info.vocab_size, 3, seed=3))


def test_greedy_output_unchanged_without_quantization(tiny_llama_dir):
    """No --quantization: the 16-bit methods, exactly as before (no quantized method anywhere)."""
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128)
    assert not any(
        isinstance(layer.method, (Fp8LinearMethod, Int4LinearMethod))
        for layer in linear_layers(llm.engine.runner.model)
    )
    _check(llm, str(tiny_llama_dir), _prompts(llm.info.vocab_size, 2, seed=1))


@pytest.mark.parametrize(
    ("layout", "tensor"),
    [
        ("ct-fp8-channel", "model.layers.0.self_attn.k_proj.weight_scale"),
        ("ct-fp8-tensor", "model.layers.0.self_attn.v_proj.weight_scale"),
        ("ct-fp8-block", "model.layers.1.mlp.down_proj.weight_scale"),
        ("awq-g128", "model.layers.0.mlp.up_proj.qzeros"),
        ("awq-g32", "model.layers.0.self_attn.q_proj.qweight"),
        ("gptq-g128-sym", "model.layers.1.self_attn.o_proj.scales"),
        ("gptq-g32-sym-actorder", "model.layers.1.mlp.gate_proj.g_idx"),
        ("ct-w4a16-g128-sym", "model.layers.0.self_attn.k_proj.weight_packed"),
        ("ct-w4a16-g128-sym", "model.layers.1.mlp.down_proj.weight_scale"),
        ("ct-w4a16-g32-asym", "model.layers.0.self_attn.v_proj.weight_shape"),
        ("ct-w4a16-g32-asym", "model.layers.1.mlp.up_proj.weight_zero_point"),
        ("ct-w4a16-g64-asym-actorder", "model.layers.0.self_attn.o_proj.weight_g_idx"),
    ],
)
def test_a_tensor_disagreeing_with_the_config_is_named(tmp_path, quantized_checkpoint, layout, tensor):
    ckpt = quantized_checkpoint(layout)
    broken, right, wrong = corrupt_tensor(ckpt.path, tmp_path / "broken", tensor)
    with pytest.raises(ValueError, match=tensor.replace(".", r"\.")) as err:
        LLM(str(broken), device="cpu", max_model_len=64)
    assert "shape" in str(err.value) and str(tuple(wrong)) in str(err.value)


@pytest.mark.parametrize(
    ("tensor", "written"),
    [
        ("model.layers.0.self_attn.k_proj.weight_shape", [64, 136]),  # k_proj is [64, 128]
        ("model.layers.1.mlp.gate_proj.weight_shape", [128, 256]),  # [256, 128], transposed
    ],
)
def test_a_pack_quantized_weight_shape_disagreeing_with_the_config_is_named(
    tmp_path, quantized_checkpoint, tensor, written
):
    ckpt = quantized_checkpoint("ct-w4a16-g32-asym")
    broken, _, _ = corrupt_tensor(ckpt.path, tmp_path / "broken", tensor, lambda t: torch.tensor(written))
    with pytest.raises(ValueError, match=tensor.replace(".", r"\.")) as err:
        LLM(str(broken), device="cpu", max_model_len=64)
    assert f"weight_shape holds {written}" in str(err.value) and "config" in str(err.value)


def _with_kv_scales(src, dst, names: dict[str, float]):
    """`src` (a compressed-tensors FP8 checkpoint) plus KV scale tensors and a kv_cache_scheme."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors.update({name: torch.tensor([value]) for name, value in names.items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("names", ["k_scale", "output_scale"])
def test_checkpoint_kv_scales_reach_the_attention_layers(tmp_path, quantized_checkpoint, names):
    ckpt = quantized_checkpoint("ct-fp8-channel")
    stem = "self_attn.{}_scale" if names == "k_scale" else "self_attn.{}_proj.output_scale"
    scales = {f"model.layers.{i}.{stem.format(kv)}": 0.5 + i + (kv == "v") for i in range(2) for kv in "kv"}
    model_dir = _with_kv_scales(ckpt.path, tmp_path / "kv", scales)
    llm = LLM(str(model_dir), device="cpu", max_model_len=128, kv_cache_dtype="fp8")
    for i, layer in enumerate(llm.engine.runner.model.layers):
        assert layer.self_attn.k_scale.tolist() == [0.5 + i] * layer.self_attn.num_kv_heads
        assert layer.self_attn.v_scale.tolist() == [1.5 + i] * layer.self_attn.num_kv_heads
    assert len(_greedy(llm, _prompts(llm.info.vocab_size, 2, seed=2))) == 2
    llm.engine.check_invariants()


def test_a_bad_checkpoint_kv_scale_is_named(tmp_path, quantized_checkpoint):
    ckpt = quantized_checkpoint("ct-fp8-channel")
    model_dir = _with_kv_scales(ckpt.path, tmp_path / "kv", {"model.layers.1.self_attn.v_scale": -1.0})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_scale: v_scale must be positive"):
        LLM(str(model_dir), device="cpu", max_model_len=128, kv_cache_dtype="fp8")
