"""Quantized mixture-of-experts checkpoints (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral)
in the published FP8 and 4-bit (AWQ, GPTQ, compressed-tensors pack-quantized) layouts, and 16-bit
MoE checkpoints quantized at load, against transformers on the dequantized weights: greedy tokens
equal and logprobs close in fp32, alone and batched with chunked prefill. The routed experts'
quantized weights (layers/moe_fp8.py, moe_int4.py) are dequantized once on the CPU, so this is the
reference path the GPU kernels are held to (tests/gpu/test_moe_fp8_gpu.py). Bad inputs: act-order
4-bit experts, a scale of the wrong shape, a missing expert tensor, a 16-bit expert weight in an FP8
checkpoint."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_quantized_models import _check, _prompts
from tests.model import quantized_checkpoints
from tests.model.quantized_checkpoints import corrupt_tensor, write_quant_source
from tokenmill import LLM
from tokenmill.errors import UnsupportedModelError
from tokenmill.model.layers.moe import MoEExperts
from tokenmill.model.layers.quantize_weights import dequantize_fp8, quantize_fp8_per_channel

quantized_checkpoint = quantized_checkpoints.quantized_checkpoint  # the session fixture


def _experts(llm: LLM) -> list[MoEExperts]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, MoEExperts)]


@pytest.mark.parametrize(
    ("layout", "source"),
    [
        ("hf-fp8-block", "qwen3-moe"),  # Qwen3-30B-A3B-FP8's layout
        ("ct-fp8-channel", "qwen3-moe"),
        ("ct-fp8-tensor", "mixtral"),  # static input scales, per-tensor weights
        ("ct-fp8-block", "qwen2-moe"),  # shared expert (a dense MLP) quantized too
    ],
)
def test_fp8_moe_checkpoint_matches_transformers_on_its_dequantized_weights(quantized_checkpoint, layout, source):
    ckpt = quantized_checkpoint(layout, source=source)
    assert any(".experts." in layer for layer in ckpt.layers)  # the writer quantized the experts
    llm = LLM(str(ckpt.path), device="cpu", max_model_len=128)
    experts = _experts(llm)
    assert experts and all(e.quant is not None and e.gate_up_proj.dtype == torch.float32 for e in experts)
    _check(llm, str(ckpt.reference), _prompts(llm.info.vocab_size, 3, seed=len(layout) + len(source)))


def test_fp8_moe_batched_with_chunked_prefill(quantized_checkpoint):
    ckpt = quantized_checkpoint("hf-fp8-block", source="qwen3-moe")
    llm = LLM(str(ckpt.path), device="cpu", max_model_len=128, max_num_batched_tokens=16, max_num_seqs=3)
    _check(llm, str(ckpt.reference), _prompts(llm.info.vocab_size, 5, seed=11))


def _at_load_reference(tmp_path, source_dir):
    """`source_dir` with every quantized projection (attention, experts, shared expert) replaced
    by its per-channel FP8 round trip, the routers left as they are: what --quantization fp8 runs."""
    from safetensors.torch import load_file, save_file

    from tests.model.quantized_checkpoints import _copy_side_files, _is_quantized

    out = tmp_path / "ref-fp8"
    out.mkdir()
    _copy_side_files(source_dir, out)
    tensors = load_file(str(source_dir / "model.safetensors"))
    for name, tensor in tensors.items():
        if _is_quantized(name):
            tensors[name] = dequantize_fp8(*quantize_fp8_per_channel(tensor.float()))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((source_dir / "config.json").read_text())
    return out


@pytest.mark.parametrize("source", ["qwen3-moe", "mixtral"])
def test_moe_quantized_to_fp8_at_load_matches_the_dequantized_reference(tmp_path, tiny_tokenizer, source):
    src = write_quant_source(tmp_path / "src", source, tiny_tokenizer)
    reference = _at_load_reference(tmp_path, src)
    llm = LLM(str(src), device="cpu", max_model_len=128, quantization="fp8")
    assert all(e.quant is not None for e in _experts(llm))
    _check(llm, str(reference), _prompts(llm.info.vocab_size, 3, seed=5))


def test_moe_greedy_output_unchanged_without_quantization(tmp_path, tiny_tokenizer):
    src = write_quant_source(tmp_path / "src", "qwen3-moe", tiny_tokenizer)
    llm = LLM(str(src), device="cpu", max_model_len=128)
    assert all(e.quant is None and e.scales is None for e in _experts(llm))
    _check(llm, str(src), _prompts(llm.info.vocab_size, 2, seed=2))


@pytest.mark.parametrize(
    ("layout", "source"),
    [("awq-g128", "qwen3-moe"), ("gptq-g32-asym", "mixtral"), ("ct-w4a16-g32-asym", "qwen2-moe"),
     ("ct-w4a16-g128-sym", "qwen3-moe")],
)  # fmt: skip
def test_4bit_moe_checkpoint_matches_transformers_on_its_dequantized_weights(quantized_checkpoint, layout, source):
    ckpt = quantized_checkpoint(layout, source=source)
    assert any(".experts." in layer for layer in ckpt.layers)
    llm = LLM(str(ckpt.path), device="cpu", max_model_len=128)
    experts = _experts(llm)
    assert experts and all(e.quant is not None and e.gate_up_proj.dtype == torch.float32 for e in experts)
    _check(llm, str(ckpt.reference), _prompts(llm.info.vocab_size, 3, seed=len(layout) + len(source)))


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_moe_quantized_to_4bit_at_load_matches_the_dequantized_reference(tmp_path, tiny_tokenizer, method):
    from tests.engine.test_quantized_models import _at_load_reference as dense_at_load_reference

    src = write_quant_source(tmp_path / "src", "qwen3-moe", tiny_tokenizer)
    reference = dense_at_load_reference(tmp_path, src, method)  # every *_proj weight, experts included
    llm = LLM(str(src), device="cpu", max_model_len=128, quantization=method)
    assert all(e.quant is not None for e in _experts(llm))
    _check(llm, str(reference), _prompts(llm.info.vocab_size, 3, seed=6))


def test_act_order_4bit_moe_is_refused_before_loading(quantized_checkpoint):
    ckpt = quantized_checkpoint("gptq-g32-sym-actorder", source="qwen3-moe")
    with pytest.raises(UnsupportedModelError, match="act-order") as err:
        LLM(str(ckpt.path), device="cpu", max_model_len=64)
    assert "qwen3_moe" in str(err.value)


@pytest.mark.parametrize(
    ("layout", "tensor", "message"),
    [
        ("hf-fp8-block", "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv", "shape"),
        ("ct-fp8-channel", "model.layers.0.mlp.experts.0.down_proj.weight_scale", "shape"),
    ],
)
def test_an_expert_scale_disagreeing_with_the_config_is_named(quantized_checkpoint, tmp_path, layout, tensor, message):
    ckpt = quantized_checkpoint(layout, source="qwen3-moe")
    broken, _, wrong = corrupt_tensor(ckpt.path, tmp_path / "broken", tensor)
    with pytest.raises(ValueError, match=tensor.replace(".", r"\.")) as err:
        LLM(str(broken), device="cpu", max_model_len=64)
    assert message in str(err.value) and str(tuple(wrong)) in str(err.value)


def test_a_16bit_expert_weight_in_an_fp8_checkpoint_is_named(quantized_checkpoint, tmp_path):
    ckpt = quantized_checkpoint("ct-fp8-channel", source="qwen3-moe")
    name = "model.layers.0.mlp.experts.1.gate_proj.weight"
    broken, _, _ = corrupt_tensor(ckpt.path, tmp_path / "broken", name, lambda t: t.float())
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as err:
        LLM(str(broken), device="cpu", max_model_len=64)
    assert "float8_e4m3fn" in str(err.value)


@pytest.mark.parametrize(
    ("layout", "name"),
    [
        ("hf-fp8-block", "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"),
        ("awq-g128", "model.layers.0.mlp.experts.2.up_proj.qzeros"),
    ],
)
def test_a_missing_expert_tensor_is_named(quantized_checkpoint, tmp_path, layout, name):
    from safetensors.torch import save_file

    from tests.model.quantized_checkpoints import _copy_side_files, read_checkpoint_tensors

    ckpt = quantized_checkpoint(layout, source="qwen3-moe")
    tensors = read_checkpoint_tensors(ckpt.path)
    del tensors[name]
    broken = tmp_path / "broken"
    _copy_side_files(ckpt.path, broken)
    (broken / "config.json").write_text((ckpt.path / "config.json").read_text())
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights") as err:
        LLM(str(broken), device="cpu", max_model_len=64)
    assert name in str(err.value)
