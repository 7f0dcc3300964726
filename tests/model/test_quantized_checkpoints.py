"""The quantized test checkpoints of tests/model/quantized_checkpoints.py: each layout's tensors have
the names, dtypes and shapes its tools write; the reference loads in transformers with exactly the
weights that the src unpacking + dequantization gives from the quantized copy (two independent
implementations agreeing); and corrupt copies trip the shape checks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from tests.model import quantized_checkpoints
from tests.model.quantized_checkpoints import (
    FP8_LAYOUTS,
    INT4_LAYOUTS,
    QUANT_LAYOUTS,
    corrupt_tensor,
    read_checkpoint_tensors,
)
from tokenmill.errors import UnsupportedModelError
from tokenmill.model.layers.quantize_weights import dequantize_fp8, dequantize_int4
from tokenmill.model.loader.int4_checkpoint import (
    check_packed_shapes,
    expected_awq_shapes,
    expected_gptq_shapes,
    expected_pack_quantized_shapes,
    unpack_awq,
    unpack_gptq,
    unpack_pack_quantized,
)

quantized_checkpoint = quantized_checkpoints.quantized_checkpoint

CASES = [(layout, "llama") for layout in QUANT_LAYOUTS] + [
    # Qwen2: q/k/v bias, intermediate 192 (partial 128x128 blocks along N and K).
    ("ct-fp8-block", "qwen2"),
    ("hf-fp8-block", "qwen2"),
    ("awq-g32", "qwen2"),
    ("gptq-g64-asym-actorder", "qwen2"),
    ("ct-w4a16-g32-asym", "qwen2"),
    # A bfloat16 source: scales of compressed-tensors in bf16, the float tensors kept in bf16.
    ("ct-fp8-channel", "llama-bf16"),
    ("ct-fp8-tensor", "llama-bf16"),
    ("awq-g128", "llama-bf16"),
    ("ct-w4a16-g128-sym", "llama-bf16"),
]
CT_W4A16_LAYOUTS = [layout for layout in QUANT_LAYOUTS if layout.startswith("ct-w4a16")]


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def _expected_layer_tensors(layout: str, n: int, k: int, model_dtype: torch.dtype) -> dict[str, tuple]:
    """leaf name -> (dtype, shape) of one quantized layer in `layout`."""
    fp8 = torch.float8_e4m3fn
    blocks = (math.ceil(n / 128), math.ceil(k / 128))
    if layout == "ct-fp8-tensor":
        return {
            "weight": (fp8, (n, k)),
            "weight_scale": (model_dtype, (1,)),
            "input_scale": (model_dtype, (1,)),
        }
    if layout == "ct-fp8-tensor-dynamic":
        return {"weight": (fp8, (n, k)), "weight_scale": (model_dtype, (1,))}
    if layout == "ct-fp8-channel":
        return {"weight": (fp8, (n, k)), "weight_scale": (model_dtype, (n, 1))}
    if layout == "ct-fp8-block":
        return {"weight": (fp8, (n, k)), "weight_scale": (model_dtype, blocks)}
    if layout == "hf-fp8-block":
        return {"weight": (fp8, (n, k)), "weight_scale_inv": (torch.float32, blocks)}
    shapes = _int4_shapes(layout, n, k)
    if layout.startswith("ct-w4a16"):
        if "actorder" not in layout:
            del shapes["weight_g_idx"]
        # Scales in the model's dtype; weight_shape as torch.tensor(weight.shape) makes it.
        dtypes = {"weight_packed": torch.int32, "weight_zero_point": torch.int32, "weight_scale": model_dtype,
                  "weight_shape": torch.int64, "weight_g_idx": torch.int32}  # fmt: skip
    else:
        dtypes = {"qweight": torch.int32, "qzeros": torch.int32, "scales": torch.float16, "g_idx": torch.int32}
    return {leaf: (dtypes[leaf], shape) for leaf, shape in shapes.items()}


def _int4_shapes(layout: str, n: int, k: int) -> dict[str, tuple[int, ...]]:
    options = QUANT_LAYOUTS[layout].keywords
    if layout.startswith("awq"):
        return expected_awq_shapes(n, k, options["group_size"])
    if layout.startswith("gptq"):
        return expected_gptq_shapes(n, k, options["group_size"])
    return expected_pack_quantized_shapes(n, k, options["group_size"], options["symmetric"])


def _dequantized_by_src(tensors: dict, layer: str, quant_config: dict) -> torch.Tensor:
    """The layer's float weight as tokenmill's src code reads it from the quantized tensors."""
    t = {leaf.rpartition(".")[2]: v for leaf, v in tensors.items() if leaf.rpartition(".")[0] == layer}
    method = quant_config["quant_method"]
    if method == "awq":
        return dequantize_int4(
            *unpack_awq(t["qweight"], t["qzeros"], t["scales"], quant_config["group_size"])
        )
    if method == "gptq":
        offset = 1 if quant_config["checkpoint_format"] == "gptq" else 0
        return dequantize_int4(
            *unpack_gptq(
                t["qweight"],
                t["qzeros"],
                t["scales"],
                t["g_idx"],
                quant_config["group_size"],
                quant_config["sym"],
                offset,
            )
        )
    if method == "fp8":
        return dequantize_fp8(t["weight"], t["weight_scale_inv"], tuple(quant_config["weight_block_size"]))
    weights = quant_config["config_groups"]["group_0"]["weights"]
    if quant_config["format"] == "pack-quantized":
        group_size = weights["group_size"] if weights["strategy"] == "group" else -1
        return dequantize_int4(
            *unpack_pack_quantized(
                t["weight_packed"], t["weight_scale"], t.get("weight_zero_point"), t.get("weight_g_idx"),
                group_size, weight_shape=t["weight_shape"], layer=layer,
            )
        )  # fmt: skip
    block = tuple(weights["block_structure"]) if weights["strategy"] == "block" else None
    return dequantize_fp8(t["weight"], t["weight_scale"], block)


@pytest.mark.parametrize(("layout", "source"), CASES, ids=[f"{layout}-{source}" for layout, source in CASES])
def test_written_checkpoint_and_its_reference(quantized_checkpoint, layout, source):
    from transformers import AutoModelForCausalLM

    ckpt = quantized_checkpoint(layout, source)
    config, reference_config = _config(ckpt.path), _config(ckpt.reference)
    quant_config = config.pop("quantization_config")
    assert "quantization_config" not in reference_config and reference_config["dtype"] == "float32"
    assert {**config, "dtype": "float32"} == reference_config  # the same model otherwise
    model_dtype = getattr(torch, config["dtype"])

    quantized = read_checkpoint_tensors(ckpt.path)
    reference = read_checkpoint_tensors(ckpt.reference)
    assert all(t.dtype == torch.float32 for t in reference.values())
    assert len(ckpt.layers) == 7 * config["num_hidden_layers"]
    expected_names = set()
    for name, ref in reference.items():
        layer = name.rpartition(".")[0]
        if layer in ckpt.layers and name.endswith(".weight"):
            n, k = ref.shape
            for leaf, (dtype, shape) in _expected_layer_tensors(layout, n, k, model_dtype).items():
                tensor = quantized[f"{layer}.{leaf}"]
                assert (tensor.dtype, tuple(tensor.shape)) == (dtype, shape), f"{layer}.{leaf}"
                expected_names.add(f"{layer}.{leaf}")
            # Independent implementations agree: the writer's reference == src unpack + dequantize.
            assert torch.equal(_dequantized_by_src(quantized, layer, quant_config), ref), layer
        else:  # embeddings, norms, biases, lm_head: as the source has them
            assert quantized[name].dtype == model_dtype and torch.equal(quantized[name].float(), ref), name
            expected_names.add(name)
    assert set(quantized) == expected_names
    assert not any(name.endswith("lm_head.weight") for name in ckpt.layers)

    model = AutoModelForCausalLM.from_pretrained(ckpt.reference, dtype=torch.float32)
    state = model.state_dict()
    for name, ref in reference.items():
        assert torch.equal(state[name], ref), name


def test_config_of_each_layout():
    from compressed_tensors.quantization import QuantizationConfig

    # compressed-tensors: its own model accepts what was written, with the scheme asked for.
    for layout, weights, inputs in [
        ("ct-fp8-tensor", "tensor", ("tensor", False)),
        ("ct-fp8-tensor-dynamic", "tensor", ("token", True)),
        ("ct-fp8-channel", "channel", ("token", True)),
        ("ct-fp8-block", "block", ("group", True)),
    ]:
        options = QUANT_LAYOUTS[layout].keywords
        config = quantized_checkpoints.compressed_tensors_fp8_config(
            options["strategy"], options["activations"]
        )
        parsed = QuantizationConfig.model_validate(config)
        scheme = parsed.config_groups["group_0"]
        assert config["quant_method"] == "compressed-tensors" and config["format"] == "float-quantized"
        assert config["ignore"] == ["lm_head"] and scheme.targets == ["Linear"]
        assert (scheme.weights.num_bits, scheme.weights.type, scheme.weights.strategy) == (
            8,
            "float",
            weights,
        )
        assert (scheme.input_activations.strategy, scheme.input_activations.dynamic) == inputs
        if weights == "block":
            assert scheme.weights.block_structure == [128, 128] and scheme.input_activations.group_size == 128
    hf, _ = QUANT_LAYOUTS["hf-fp8-block"](None, torch.float32)
    assert hf == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    awq, _ = QUANT_LAYOUTS["awq-g32"](None, torch.float32)
    assert (awq["quant_method"], awq["version"], awq["bits"], awq["group_size"], awq["zero_point"]) == (
        "awq",
        "gemm",
        4,
        32,
        True,
    )
    for layout in INT4_LAYOUTS:
        if layout.startswith("gptq"):
            gptq, _ = QUANT_LAYOUTS[layout](None, torch.float32)
            assert gptq["quant_method"] == "gptq" and gptq["bits"] == 4
            assert gptq["checkpoint_format"] == ("gptq_v2" if "v2" in layout else "gptq")
            assert gptq["desc_act"] == ("actorder" in layout) and gptq["sym"] == ("-sym" in layout)
    for layout in CT_W4A16_LAYOUTS:
        config, _ = QUANT_LAYOUTS[layout](None, torch.float32)
        weights = config["config_groups"]["group_0"]["weights"]
        assert (config["quant_method"], config["format"], config["ignore"]) == (
            "compressed-tensors", "pack-quantized", ["lm_head"],
        )  # fmt: skip
        assert config["config_groups"]["group_0"]["input_activations"] is None
        assert weights["symmetric"] == ("-sym" in layout) and weights.get("actorder") == (
            "group" if "actorder" in layout else QUANT_LAYOUTS[layout].keywords["actorder"]
        )
        # compressed-tensors 0.20 refuses the actorder "group" it once wrote; its model checks the rest.
        scheme = QuantizationConfig.model_validate(
            {**config, "config_groups": {"group_0": {**config["config_groups"]["group_0"],
                                                     "weights": {**weights, "actorder": None}}}}
        ).config_groups["group_0"]  # fmt: skip
        strategy = "channel" if "channel" in layout else "group"
        assert (scheme.weights.num_bits, scheme.weights.type, scheme.weights.strategy) == (4, "int", strategy)


def test_static_input_scales_are_calibrated(quantized_checkpoint):
    ckpt = quantized_checkpoint("ct-fp8-tensor")
    tensors = read_checkpoint_tensors(ckpt.path)
    scales = {layer: tensors[f"{layer}.input_scale"] for layer in ckpt.layers}
    assert all(s.shape == (1,) and float(s) > 0 for s in scales.values())
    # The MLP's down_proj sees the SwiGLU output, not the normed hidden state its q_proj sees.
    assert float(scales["model.layers.0.mlp.down_proj"]) != float(scales["model.layers.0.self_attn.q_proj"])


def test_act_order_checkpoints_have_shuffled_g_idx(quantized_checkpoint):
    ckpt = quantized_checkpoint("gptq-g32-sym-actorder")
    tensors = read_checkpoint_tensors(ckpt.path)
    for layer in ckpt.layers:
        g_idx = tensors[f"{layer}.g_idx"]
        k = g_idx.numel()
        assert sorted(g_idx.tolist()) == [i // 32 for i in range(k)]
        assert g_idx.tolist() != [i // 32 for i in range(k)]
    plain = read_checkpoint_tensors(quantized_checkpoint("gptq-g32-asym").path)
    assert plain["model.layers.1.mlp.down_proj.g_idx"].tolist() == [i // 32 for i in range(256)]


@pytest.mark.parametrize("layout", [layout for layout in CT_W4A16_LAYOUTS if "actorder" not in layout])
def test_w4a16_layers_decompress_as_compressed_tensors_does(quantized_checkpoint, layout):
    """compressed-tensors' own decompressor reads each written layer as the reference weight (its
    0.20 release no longer takes actorder "group", so that layout is checked by the src unpacking)."""
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    ckpt = quantized_checkpoint(layout)
    scheme = QuantizationScheme.model_validate(_config(ckpt.path)["quantization_config"]["config_groups"]["group_0"])
    quantized, reference = read_checkpoint_tensors(ckpt.path), read_checkpoint_tensors(ckpt.reference)
    for layer in ckpt.layers:
        own = {leaf.rpartition(".")[2]: t for leaf, t in quantized.items() if leaf.rpartition(".")[0] == layer}
        weight = PackedQuantizationCompressor.decompress(own, scheme)["weight"]
        assert torch.equal(weight.float(), reference[f"{layer}.weight"]), layer


def test_w4a16_act_order_writes_shuffled_g_idx_shared_by_an_input(quantized_checkpoint):
    tensors = read_checkpoint_tensors(quantized_checkpoint("ct-w4a16-g64-asym-actorder").path)
    attn = "model.layers.0.self_attn"
    g_idx = tensors[f"{attn}.q_proj.weight_g_idx"]
    assert sorted(g_idx.tolist()) == [i // 64 for i in range(128)] and g_idx.tolist() != sorted(g_idx.tolist())
    assert torch.equal(tensors[f"{attn}.k_proj.weight_g_idx"], g_idx)
    assert not torch.equal(tensors[f"{attn}.o_proj.weight_g_idx"], g_idx)


@pytest.mark.parametrize(
    ("layout", "tensor"),
    [
        ("gptq-g32-asym", "qzeros"),
        ("awq-g32", "qweight"),
        ("awq-g128", "scales"),
        ("gptq-g128-sym", "g_idx"),
        ("ct-w4a16-g128-sym", "weight_packed"),
        ("ct-w4a16-g32-asym", "weight_zero_point"),
        ("ct-w4a16-g64-asym-actorder", "weight_g_idx"),
        ("ct-w4a16-channel-sym", "weight_scale"),
    ],
)
def test_corrupt_int4_tensor_is_named_by_the_shape_check(quantized_checkpoint, tmp_path, layout, tensor):
    ckpt = quantized_checkpoint(layout)
    name = f"model.layers.1.self_attn.k_proj.{tensor}"
    bad_dir, right, wrong = corrupt_tensor(ckpt.path, tmp_path / "bad", name)
    assert wrong != right
    tensors = read_checkpoint_tensors(bad_dir)
    layer = name.rpartition(".")[0]
    n, k = 64, 128  # k_proj: 2 KV heads of 32 from hidden 128
    shapes = _int4_shapes(layout, n, k)
    own = {leaf: tensors.get(f"{layer}.{leaf}") for leaf in shapes}
    with pytest.raises(UnsupportedModelError) as err:
        check_packed_shapes(layer, own, shapes, layout)
    assert f"{name} has shape {wrong}" in str(err.value) and f"needs {right}" in str(err.value)


def test_corrupt_fp8_scale_is_refused(quantized_checkpoint, tmp_path):
    ckpt = quantized_checkpoint("ct-fp8-channel")
    name = "model.layers.0.mlp.gate_proj.weight_scale"
    bad_dir, right, wrong = corrupt_tensor(ckpt.path, tmp_path / "bad", name, lambda t: t[:-1])
    assert (right, wrong) == ([256, 1], [255, 1])
    with safe_open(str(bad_dir / "model.safetensors"), "pt") as f:
        weight, scale = f.get_tensor("model.layers.0.mlp.gate_proj.weight"), f.get_tensor(name)
    with pytest.raises(ValueError, match=r"got shape \(255, 1\)"):
        dequantize_fp8(weight, scale)
    assert _config(bad_dir) == _config(ckpt.path)


def test_layout_lists_cover_every_layout():
    assert sorted(FP8_LAYOUTS + INT4_LAYOUTS) == sorted(QUANT_LAYOUTS)
    assert {layout for layout, _ in CASES} == set(QUANT_LAYOUTS)
    assert CT_W4A16_LAYOUTS and set(CT_W4A16_LAYOUTS) <= set(INT4_LAYOUTS)
