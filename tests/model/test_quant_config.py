"""A checkpoint whose quantization_config asks for what tokenmill cannot run (a method, bits, a group
size) is refused at resolve time, before any weight is read, naming it and what is supported."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.model.hub_cache import FakeHub, use_hf_home
from tokenmill.config import ModelConfig
from tokenmill.errors import UnsupportedModelError
from tokenmill.model.loader import quant_config
from tokenmill.model.resolve import resolve_model


def _quantized_copy(source, target, quantization_config):
    """The config of `source` with `quantization_config`, and no weights at all: the refusal must
    come before anything looks for them."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("quant", "named"),
    [
        ({"quant_method": "bitsandbytes", "bits": 4}, "quant_method = 'bitsandbytes'"),
        ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size=100"),
    ],
)
def test_an_unsupported_quantization_is_refused_before_loading(tmp_path, tiny_llama_dir, quant, named):
    model_dir = _quantized_copy(tiny_llama_dir, tmp_path / "q", quant)
    with pytest.raises(UnsupportedModelError) as err:
        resolve_model(ModelConfig(model=str(model_dir)))
    message = str(err.value)
    assert named in message and "supported" in message
    assert str(model_dir) in message and err.value.param == "model"


def test_a_quantized_hub_model_is_refused_before_its_weights_are_fetched(tmp_path, monkeypatch, tiny_llama_dir):
    hub_cache = use_hf_home(monkeypatch, tmp_path / "hf_home", offline=False)
    remote = _quantized_copy(tiny_llama_dir, tmp_path / "remote", {"quant_method": "AWQ", "bits": 8})
    shutil.copy(tiny_llama_dir / "model.safetensors", remote / "model.safetensors")
    hub = FakeHub(monkeypatch, hub_cache, remote)
    with pytest.raises(UnsupportedModelError, match=r"org/m-AWQ: awq checkpoint with bits=8"):
        resolve_model(ModelConfig(model="org/m-AWQ"))
    assert hub.fetched == [["config.json"]]  # the weights were never asked for


def test_a_supported_config_resolves_to_its_spec(tmp_path, tiny_llama_dir):
    fp8_dir = _quantized_copy(tiny_llama_dir, tmp_path / "fp8", {"quant_method": "fp8"})
    assert quant_config.check_quantization_config(json.loads((fp8_dir / "config.json").read_text()), "x") == "fp8"
    # (this directory then fails on its missing weights, after the check)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors or pytorch_model\\*.bin weights"):
        resolve_model(ModelConfig(model=str(fp8_dir)))
    shutil.copy(tiny_llama_dir / "model.safetensors", fp8_dir / "model.safetensors")
    resolved = resolve_model(ModelConfig(model=str(fp8_dir)))
    assert resolved.quantization is not None and resolved.quantization.fp8_weight_strategy == "tensor"
    assert resolve_model(ModelConfig(model=str(tiny_llama_dir), quantization="awq")).quantization == (
        quant_config.at_load_quantization("awq")
    )


def test_a_mixture_of_experts_model_takes_fp8_but_not_4_bit_quantization(tmp_path, tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)  # fmt: skip
    moe_dir = tmp_path / "moe"
    moe_dir.mkdir()
    (moe_dir / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_llama_dir / "model.safetensors", moe_dir / "model.safetensors")
    resolved = resolve_model(ModelConfig(model=str(moe_dir), quantization="fp8"))
    assert resolved.quantization is not None and resolved.quantization.scheme == "fp8_w8a8"
    for method in ("awq", "gptq"):
        with pytest.raises(UnsupportedModelError, match="qwen3_moe model is not supported yet.*FP8 expert weights"):
            resolve_model(ModelConfig(model=str(moe_dir), quantization=method))


def test_a_quantization_config_without_a_method_is_refused(tmp_path, tiny_llama_dir):
    model_dir = _quantized_copy(tiny_llama_dir, tmp_path / "q", {"bits": 4})
    with pytest.raises(UnsupportedModelError, match="quantization_config without a quant_method"):
        resolve_model(ModelConfig(model=str(model_dir)))
