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


def test_a_mixture_of_experts_model_takes_fp8_and_4_bit_quantization(tmp_path, tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)  # fmt: skip
    moe_dir = tmp_path / "moe"
    moe_dir.mkdir()
    (moe_dir / "config.json").write_text(json.dumps(config))
    shutil.copy(tiny_llama_dir / "model.safetensors", moe_dir / "model.safetensors")
    for method, scheme in (("fp8", "fp8_w8a8"), ("awq", "int4_w4a16"), ("gptq", "int4_w4a16")):
        resolved = resolve_model(ModelConfig(model=str(moe_dir), quantization=method))
        assert resolved.quantization is not None and resolved.quantization.scheme == scheme
    act_order = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": True}
    (moe_dir / "config.json").write_text(json.dumps({**config, "quantization_config": act_order}))
    with pytest.raises(UnsupportedModelError, match="qwen3_moe model is not supported yet.*act-order"):
        resolve_model(ModelConfig(model=str(moe_dir)))


def test_a_quantization_config_without_a_method_is_refused(tmp_path, tiny_llama_dir):
    model_dir = _quantized_copy(tiny_llama_dir, tmp_path / "q", {"bits": 4})
    with pytest.raises(UnsupportedModelError, match="quantization_config without a quant_method"):
        resolve_model(ModelConfig(model=str(model_dir)))


# ------------------------------------------------------------ compressed-tensors pack-quantized (W4A16)


def _w4a16(weights: dict | None = None, group: dict | None = None, **top) -> dict:
    """A pack-quantized quantization_config as llm-compressor writes it, with `weights` / `group` /
    top-level fields overridden."""
    scheme = {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128, "strategy": "group",
                    "dynamic": False, "actorder": None, **(weights or {})},
        "input_activations": None, "output_activations": None, "format": None, **(group or {}),
    }  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": scheme},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed", **top}  # fmt: skip


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        ({}, (128, False, False, "groups of 128, symmetric; pack-quantized checkpoint")),
        ({"symmetric": False, "group_size": 32, "actorder": "weight"}, (32, True, False, "groups of 32, zero points;")),
        ({"group_size": 64, "actorder": "static"}, (64, False, False, "groups of 64, symmetric;")),
        ({"symmetric": False, "group_size": 64, "actorder": "group"}, (64, True, True, "zero points, act-order;")),
        ({"actorder": "dynamic"}, (128, False, True, "act-order")),  # older compressed-tensors' alias
        ({"strategy": "channel", "group_size": None}, (-1, False, False, "per-channel, symmetric;")),
        ({"strategy": None, "group_size": 32}, (32, False, False, "groups of 32")),  # strategy inferred
    ],
)
def test_pack_quantized_configs_resolve_to_int4_specs(weights, expected):
    spec = quant_config.checkpoint_quantization(_config_of(_w4a16(weights)), "org/m-w4a16")
    assert spec is not None
    assert (spec.method, spec.scheme, spec.from_checkpoint, spec.int4_format) == (
        "compressed-tensors", "int4_w4a16", True, "pack-quantized",
    )  # fmt: skip
    group_size, zero_point, act_order, described = expected
    assert (spec.group_size, spec.zero_point, spec.act_order) == (group_size, zero_point, act_order)
    assert spec.describe().startswith("compressed-tensors: INT4 W4A16") and described in spec.describe()
    assert spec.is_ignored("lm_head") and not spec.is_ignored("model.layers.0.mlp.down_proj")
    # Dummy weights of its config: 4-bit groups quantized at load, in the checkpoint's scheme.
    dummy = quant_config.resolve_quantization(_config_of(_w4a16(weights)), None, "m", dummy=True)
    assert dummy is not None and not dummy.from_checkpoint and not dummy.act_order
    assert (dummy.group_size, dummy.zero_point) == (group_size, zero_point)


def _config_of(quant: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "quantization_config": quant}


@pytest.mark.parametrize(
    ("quant", "named", "supported"),
    [
        (_w4a16({"num_bits": 8}), "num_bits=8", "num_bits 4"),
        (_w4a16({"num_bits": 4, "type": "float"}), "pack-quantized weights of type 'float'", "type 'int'"),
        (_w4a16({"group_size": 16}), "group_size=16", "group_size 32, 64, 128"),
        (_w4a16({"strategy": "tensor", "group_size": None}), "4-bit weight strategy 'tensor'", "'channel'"),
        (_w4a16({"dynamic": True}), "dynamic weight scales (dynamic=True)", "dynamic false"),
        (_w4a16({"actorder": "columns"}), "actorder='columns'", "'group'"),
        (_w4a16(group={"input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}),
         "quantized input_activations", "W4A16"),
        (_w4a16(group={"targets": ["re:.*mlp.*"]}), "targets=['re:.*mlp.*']", "['Linear']"),
        (_w4a16(format="marlin-24"), "format='marlin-24'", "'pack-quantized'"),
        (_w4a16(format="mixed-precision", config_groups={
            "group_0": _w4a16()["config_groups"]["group_0"] | {"format": "pack-quantized"},
            "group_1": _w4a16()["config_groups"]["group_0"] | {"format": "float-quantized"}}),
         "config groups of different formats (float-quantized, pack-quantized)", "one format"),
        (_w4a16(config_groups={"group_0": _w4a16()["config_groups"]["group_0"],
                               "group_1": _w4a16({"group_size": 32})["config_groups"]["group_0"]}),
         "config groups of different schemes", "one scheme"),
        (_w4a16(kv_cache_scheme={"num_bits": 8, "type": "int"}), "kv_cache_scheme", "FP8"),
    ],
)  # fmt: skip
def test_unsupported_pack_quantized_configs_are_refused_naming_the_field(quant, named, supported):
    with pytest.raises(UnsupportedModelError) as err:
        quant_config.checkpoint_quantization(_config_of(quant), "org/m-w4a16")
    message = str(err.value)
    assert named in message and supported in message.partition("supported:")[2], message
    assert message.startswith("org/m-w4a16: compressed-tensors checkpoint with") and err.value.param == "model"


def test_a_pack_quantized_checkpoint_resolves_for_dense_and_moe_models(tmp_path, tiny_llama_dir):
    model_dir = _quantized_copy(tiny_llama_dir, tmp_path / "w4a16", _w4a16({"symmetric": False, "group_size": 32}))
    shutil.copy(tiny_llama_dir / "model.safetensors", model_dir / "model.safetensors")
    spec = resolve_model(ModelConfig(model=str(model_dir))).quantization
    assert spec is not None and (spec.int4_format, spec.group_size, spec.zero_point) == ("pack-quantized", 32, True)
    assert resolve_model(ModelConfig(model=str(model_dir), quantization="compressed-tensors")).quantization == spec
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16)  # fmt: skip
    (model_dir / "config.json").write_text(json.dumps(config))
    assert resolve_model(ModelConfig(model=str(model_dir))).quantization == spec  # 4-bit experts (CPU)


def _arch(heads: int = 32, kv_heads: int = 8, head_dim: int = 128, intermediate: int = 14336):
    from types import SimpleNamespace

    return SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                           intermediate_size=intermediate, moe=None)  # fmt: skip


def test_pack_quantized_tensor_parallel_alignment():
    def spec(**weights):
        return quant_config.checkpoint_quantization(_config_of(_w4a16(weights)), "m")

    llama_8b = _arch()
    for size in (1, 2, 4, 8):
        assert quant_config.tensor_parallel_refusal(spec(), llama_8b, size) is None
        assert quant_config.tensor_parallel_refusal(spec(symmetric=False, group_size=32), llama_8b, size) is None
    refusal = quant_config.tensor_parallel_refusal(spec(actorder="group"), llama_8b, 2)
    assert refusal is not None and "act-order" in refusal and "tensor_parallel_size=1" in refusal
    # Input columns go to the ranks in whole groups and packed words: down_proj's 2 x 1920 / 2 = 1920
    # columns hold 15 groups of 128, but 1920 / 4 = 960 do not.
    odd = _arch(heads=8, kv_heads=8, head_dim=64, intermediate=3840)
    assert quant_config.tensor_parallel_refusal(spec(), odd, 2) is None
    refusal = quant_config.tensor_parallel_refusal(spec(), odd, 4)
    assert refusal is not None and "down_proj 960 input columns (blocks of 128)" in refusal
    # Output rows: symmetric checkpoints pack nothing along them; zero points pack 8 rows a word.
    # (k / v: 4 KV heads of 4 over 4 ranks are 4 rows a rank.)
    rows = _arch(heads=32, kv_heads=4, head_dim=4, intermediate=256)
    assert quant_config.tensor_parallel_refusal(spec(group_size=32), rows, 4) is None
    refusal = quant_config.tensor_parallel_refusal(spec(symmetric=False, group_size=32), rows, 4)
    assert refusal is not None and "k_proj / v_proj 4 output rows (blocks of 8)" in refusal
