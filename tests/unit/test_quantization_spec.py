"""Parsing quantization configs into a QuantizationSpec, torch-free, and refusing what we cannot run
(method, bits, group size, scheme) before any weight is read."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.loader.quant_config import (
    QuantizationSpec,
    at_load_quantization,
    checkpoint_quantization,
    resolve_quantization,
)


def _config(quant: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "quantization_config": quant}


def _ct(weights: dict, acts: dict | None = None, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, **weights}}
    if acts is not None:
        group["input_activations"] = {"num_bits": 8, "type": "float", **acts}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group},
            "ignore": ["lm_head"], **extra}  # fmt: skip


def test_unquantized_checkpoint_and_no_request_is_none():
    assert resolve_quantization({"architectures": ["X"]}, None, "m") is None
    assert resolve_quantization(None, None, "m.gguf") is None


@pytest.mark.parametrize(
    ("weights", "acts", "strategy", "static"),
    [
        ({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False}, "tensor", True),
        ({"strategy": "channel"}, {"strategy": "token", "dynamic": True}, "channel", False),
        ({"strategy": "block", "block_structure": [128, 128]}, {"strategy": "group", "group_size": 128,
                                                                "dynamic": True}, "block", False),
        ({"strategy": "channel"}, None, "channel", False),
    ],
)
def test_compressed_tensors_fp8(weights, acts, strategy, static):
    spec = checkpoint_quantization(_config(_ct(weights, acts)), "m")
    assert spec is not None
    assert (spec.method, spec.scheme, spec.from_checkpoint) == ("compressed-tensors", "fp8_w8a8", True)
    assert spec.fp8_weight_strategy == strategy
    assert spec.fp8_static_input_scales is static
    assert spec.fp8_block == ((128, 128) if strategy == "block" else None)
    assert spec.is_ignored("lm_head") and not spec.is_ignored("model.layers.0.mlp.down_proj")


def test_hf_fp8_block_and_per_tensor():
    block = checkpoint_quantization(
        _config({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}), "m"
    )
    assert block is not None and block.fp8_weight_strategy == "block"
    assert block.fp8_scale_name == "weight_scale_inv"
    tensor = checkpoint_quantization(_config({"quant_method": "fp8", "activation_scheme": "static"}), "m")
    assert tensor is not None and tensor.fp8_weight_strategy == "tensor" and tensor.fp8_static_input_scales


def test_awq_and_gptq():
    awq = checkpoint_quantization(
        _config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                 "modules_to_not_convert": ["re:.*down_proj"]}), "m")  # fmt: skip
    assert awq is not None and (awq.int4_format, awq.group_size, awq.zero_point) == ("awq", 128, True)
    assert awq.is_ignored("model.layers.3.mlp.down_proj") and not awq.is_ignored("model.layers.3.mlp.up_proj")
    gptq = checkpoint_quantization(
        _config({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}), "m"
    )
    assert gptq is not None
    assert (gptq.int4_format, gptq.group_size, gptq.zero_point, gptq.act_order, gptq.gptq_zeros_offset) == (
        "gptq", 32, False, True, 1,
    )  # fmt: skip
    v2 = checkpoint_quantization(
        _config({"quant_method": "gptq", "bits": 4, "group_size": -1, "sym": False, "checkpoint_format": "gptq_v2"}),
        "m",
    )
    assert v2 is not None and (v2.group_size, v2.zero_point, v2.gptq_zeros_offset) == (-1, True, 0)


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "bits=8"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "awq", "bits": 4, "group_size": 256}, "group_size=256"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized"),
        (_ct({"strategy": "group", "group_size": 128}), "strategy 'group'"),
        (_ct({"strategy": "block", "block_structure": [64, 64]}), "block_structure"),
        (_ct({"strategy": "channel"}, {"strategy": "tensor", "dynamic": True}), "input activation strategy"),
        ({**_ct({"strategy": "channel"}), "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group"}}}}, "4 bits"),
    ],
)
def test_unsupported_configs_are_refused_naming_what(quant, named):
    with pytest.raises(UnsupportedModelError) as err:
        checkpoint_quantization(_config(quant), "org/model")
    assert named in str(err.value) and "org/model" in str(err.value)


def test_requested_method_must_match_the_checkpoint():
    config = _config({"quant_method": "awq", "bits": 4, "group_size": 128})
    with pytest.raises(UnsupportedModelError, match="'awq' checkpoint"):
        resolve_quantization(config, "fp8", "m")
    assert resolve_quantization(config, "awq", "m") == resolve_quantization(config, None, "m")


def test_at_load_and_dummy():
    fp8 = resolve_quantization({"architectures": ["X"]}, "fp8", "m")
    assert fp8 == at_load_quantization("fp8") and not fp8.from_checkpoint
    assert resolve_quantization(None, "gptq", "m.gguf") == at_load_quantization("gptq")
    with pytest.raises(UnsupportedModelError, match="needs a compressed-tensors checkpoint"):
        resolve_quantization({"architectures": ["X"]}, "compressed-tensors", "m")
    with pytest.raises(UnsupportedModelError, match="choose one of"):
        resolve_quantization(None, "int3", "m")
    dummy = resolve_quantization(_config({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True}),
                                 None, "m", dummy=True)  # fmt: skip
    assert isinstance(dummy, QuantizationSpec) and not dummy.from_checkpoint and dummy.group_size == 64


def test_spec_describes_itself():
    assert "FP8 W8A8" in at_load_quantization("fp8").describe()
    assert "groups of 128" in at_load_quantization("awq").describe()


def test_parsing_stays_torch_free():
    code = (
        "import sys; from tokenmill.model.loader.quant_config import resolve_quantization; "
        "resolve_quantization({'quantization_config': {'quant_method': 'awq', 'bits': 4, 'group_size': 128}}, None, 'm'); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
