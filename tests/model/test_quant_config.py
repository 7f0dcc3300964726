"""A checkpoint whose quantization_config names a method tokenmill cannot run is refused at
resolve time, torch-free and before any weight is read, naming the method and the supported ones."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.model.hub_cache import FakeHub, use_hf_home
from tokenmill.config import ModelConfig
from tokenmill.errors import UnsupportedModelError
from tokenmill.model.loader import quant_config
from tokenmill.model.resolve import resolve_model

METHODS = ["awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes"]


def _quantized_copy(source, target, quantization_config):
    """The config of `source` with `quantization_config`, and no weights at all: the refusal must
    come before anything looks for them."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("method", METHODS)
def test_an_unsupported_quantization_method_is_refused_before_loading(tmp_path, tiny_llama_dir, method):
    model_dir = _quantized_copy(tiny_llama_dir, tmp_path / "q", {"quant_method": method, "bits": 4})
    with pytest.raises(UnsupportedModelError) as err:
        resolve_model(ModelConfig(model=str(model_dir)))
    message = str(err.value)
    assert f"quant_method = {method!r}" in message and "supported quantization methods: none yet" in message
    assert str(model_dir) in message and err.value.param == "model"


def test_a_quantized_hub_model_is_refused_before_its_weights_are_fetched(tmp_path, monkeypatch, tiny_llama_dir):
    hub_cache = use_hf_home(monkeypatch, tmp_path / "hf_home", offline=False)
    remote = _quantized_copy(tiny_llama_dir, tmp_path / "remote", {"quant_method": "AWQ"})
    shutil.copy(tiny_llama_dir / "model.safetensors", remote / "model.safetensors")
    hub = FakeHub(monkeypatch, hub_cache, remote)
    with pytest.raises(UnsupportedModelError, match=r"org/m-AWQ is a quantized checkpoint .*'awq'"):
        resolve_model(ModelConfig(model="org/m-AWQ"))
    assert hub.fetched == [["config.json"]]  # the weights were never asked for


def test_the_registry_is_what_the_check_accepts_and_lists(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setitem(quant_config.SUPPORTED_QUANTIZATION_METHODS, "fp8", "Fp8LinearMethod")
    monkeypatch.setitem(quant_config.SUPPORTED_QUANTIZATION_METHODS, "awq", "AWQLinearMethod")
    model_dir = _quantized_copy(tiny_llama_dir, tmp_path / "gptq", {"quant_method": "gptq"})
    with pytest.raises(UnsupportedModelError, match="supported quantization methods: awq, fp8"):
        resolve_model(ModelConfig(model=str(model_dir)))
    # A supported method passes the check (this directory then fails on its missing weights).
    fp8_dir = _quantized_copy(tiny_llama_dir, tmp_path / "fp8", {"quant_method": "fp8"})
    assert quant_config.check_quantization_config(json.loads((fp8_dir / "config.json").read_text()), "x") == "fp8"
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors or pytorch_model\\*.bin weights"):
        resolve_model(ModelConfig(model=str(fp8_dir)))


def test_a_quantization_config_without_a_method_is_refused(tmp_path, tiny_llama_dir):
    model_dir = _quantized_copy(tiny_llama_dir, tmp_path / "q", {"bits": 4})
    with pytest.raises(UnsupportedModelError, match="quantization_config without a quant_method"):
        resolve_model(ModelConfig(model=str(model_dir)))
