"""Quantized Gemma 2, Gemma 3 (text) and Phi-3 checkpoints against transformers on the dequantized
weights (greedy tokens equal, logprobs within 1e-4, fp32 on the CPU's reference path), as
test_quantized_models.py holds the Llama family. Gemma brings soft caps, sliding windows, Q/K norms
and tied embeddings around the same linear layers; Phi-3 stores q/k/v and gate/up fused, so a
quantized Phi-3 tensor (packed words, scales, block scales, g_idx, weight_shape) is split into the
merged layer's parts by its layout (layers/linear.py MergedColumnParallelLinear.weight_loader)."""

from __future__ import annotations

import pytest

from tests.engine.test_quantized_models import _at_load_reference, _check, _prompts
from tests.model import quantized_checkpoints
from tests.model.quantized_checkpoints import write_quant_source
from tokenmill import LLM
from tokenmill.model.layers.linear import linear_layers
from tokenmill.model.layers.quantized_method import QuantizedLinearMethod

quantized_checkpoint = quantized_checkpoints.quantized_checkpoint  # the session fixture


@pytest.mark.parametrize(
    ("source", "layout"),
    [
        ("gemma2", "hf-fp8-block"),
        ("gemma2", "awq-g128"),
        ("gemma3", "ct-fp8-channel"),
        ("gemma3", "gptq-g32-sym-actorder"),
        ("phi3", "ct-fp8-tensor"),  # one static scale for each fused tensor, shared by its parts
        ("phi3", "hf-fp8-block"),
        ("phi3", "awq-g128"),  # packed along the output: the fused words split at part boundaries
        ("phi3", "gptq-g32-sym-actorder"),  # one g_idx for the fused tensor
        ("phi3", "ct-w4a16-g32-asym"),  # weight_shape of the fused tensor
    ],
)
def test_quantized_checkpoint_of_another_family_matches_transformers(quantized_checkpoint, source, layout):
    ckpt = quantized_checkpoint(layout, source=source)
    llm = LLM(str(ckpt.path), device="cpu", max_model_len=128)
    assert any(isinstance(layer.method, QuantizedLinearMethod) for layer in linear_layers(llm.engine.runner.model))
    _check(llm, str(ckpt.reference), _prompts(llm.info.vocab_size, 3, seed=len(layout)))


@pytest.mark.parametrize(("source", "method"), [("gemma2", "fp8"), ("phi3", "awq")])
def test_another_family_quantized_at_load_matches_the_dequantized_reference(tmp_path, tiny_tokenizer, source, method):
    src = write_quant_source(tmp_path / "src", source, tiny_tokenizer)
    reference = _at_load_reference(tmp_path, src, method)
    llm = LLM(str(src), device="cpu", max_model_len=128, quantization=method)
    _check(llm, str(reference), _prompts(llm.info.vocab_size, 3, seed=4))


def test_a_fused_tensor_whose_parts_split_a_block_is_refused(quantized_checkpoint, tmp_path):
    """Phi-3's fused gate_up scales with the wrong number of 128-row blocks: named, with the split."""
    ckpt = quantized_checkpoint("hf-fp8-block", source="phi3")
    name = "model.layers.0.mlp.gate_up_proj.weight_scale_inv"
    broken, _, wrong = quantized_checkpoints.corrupt_tensor(ckpt.path, tmp_path / "broken", name)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")) as err:
        LLM(str(broken), device="cpu", max_model_len=64)
    assert f"{tuple(wrong)}" in str(err.value) and "entries along dim 0; expected the parts' 2 + 2 = 4 (128 rows an entry)" in str(err.value)
