"""The deferred RMSNorm's fold for quantized linear layers (layers/quantized_method.py): FP8 weights
quantized at load on the GPU take the norm weight into their 16-bit form before they are quantized;
INT4, checkpoint weights and the CPU's reference path do not fold. The kernels are not run here (the
layers' products are tested in test_fp8_kernels.py / test_int4_kernels.py; the folded models on the
GPU in tests/gpu/test_quantized_gpu.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.model.layers.fp8_linear import Fp8LinearMethod
from tokenmill.model.layers.int4_linear import Int4LinearMethod
from tokenmill.model.layers.linear import ReplicatedLinear
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.loader.quant_config import at_load_quantization

METHODS = {"fp8": Fp8LinearMethod, "awq": Int4LinearMethod}


def _layer(method_name: str, use_kernels: bool, seed: int = 0):
    spec = at_load_quantization(method_name)
    method = METHODS[method_name](spec, LinearMethod(), use_kernels=use_kernels)
    layer = ReplicatedLinear(256, 128, method=method, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    layer.weight.data.copy_(torch.randn(128, 256, generator=gen) * 0.05)
    return layer, method, gen


def _kernel_form(layer):
    """The prepared kernel tensors, comparable across layers."""
    prepared = layer.quantized_weights
    return [getattr(prepared, f.name) for f in dataclasses.fields(prepared) if f.name not in ("tile_counters",)]


def test_at_load_fp8_weights_fold_the_norm_weight_before_they_are_quantized() -> None:
    """Folding then quantizing gives exactly the kernels' form of quantize(W * norm weight)."""
    method_name = "fp8"
    folded, method, gen = _layer(method_name, use_kernels=True)
    norm_weight = (torch.rand(256, generator=gen) + 0.5).to(torch.bfloat16)
    reference, reference_method, _ = _layer(method_name, use_kernels=True)
    reference.weight.data.mul_(norm_weight)
    assert method.folds_input_scale
    folded.fold_input_scale(norm_weight)
    assert folded.folded_input_scale is norm_weight  # a LoRA adapter's A takes it too
    method.process_layers_after_loading([folded])
    reference_method.process_layers_after_loading([reference])
    for got, expected in zip(_kernel_form(folded), _kernel_form(reference), strict=True):
        if isinstance(got, torch.Tensor):
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                               expected.view(torch.uint8) if expected.dtype == torch.float8_e4m3fn else expected)  # fmt: skip
        else:
            assert got == expected
    with pytest.raises(ValueError, match="before it quantizes them"):
        folded.fold_input_scale(norm_weight)  # quantized already: it would need a requantization


@pytest.mark.parametrize("method_name", list(METHODS))
def test_int4_checkpoint_weights_and_the_cpu_path_do_not_fold(method_name: str) -> None:
    _, cpu_method, _ = _layer(method_name, use_kernels=False)
    assert not cpu_method.folds_input_scale
    _, gpu_method, _ = _layer(method_name, use_kernels=True)
    assert gpu_method.folds_input_scale == (method_name == "fp8")  # INT4's shared grids: not folded
    spec = dataclasses.replace(at_load_quantization(method_name), from_checkpoint=True)
    assert not METHODS[method_name](spec, LinearMethod(), use_kernels=True).folds_input_scale
    layer, _, _ = _layer(method_name, use_kernels=False)
    with pytest.raises(ValueError, match="cannot fold a scale"):
        layer.fold_input_scale(torch.ones(256))
