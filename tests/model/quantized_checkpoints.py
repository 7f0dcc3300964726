"""Quantized copies of tiny checkpoints in the layouts quantization tools publish, each beside its
dequantized reference: the same model with float32 weights equal to the dequantized quantized
weights and no quantization_config, so transformers on the reference is the oracle for an engine
running the quantized copy.

| layout         | quantization_config                                | tensors of a quantized layer    |
| ct-fp8-tensor  | compressed-tensors float-quantized, weights tensor | weight (fp8), weight_scale [1], |
|                | input_activations static tensor (llm-compressor    | input_scale [1]                 |
|                | "FP8"); ct-fp8-tensor-dynamic: dynamic token       |                                 |
| ct-fp8-channel | ... weights channel, activations dynamic token     | weight, weight_scale [N, 1]     |
| ct-fp8-block   | ... weights block [128, 128], dynamic group 128    | weight, weight_scale [⌈N/128⌉,  |
|                |                                                    | ⌈K/128⌉]                        |
| hf-fp8-block   | quant_method fp8, weight_block_size [128, 128]     | weight, weight_scale_inv (fp32) |
| awq-g{G}       | quant_method awq, version gemm, bits 4, zero_point | qweight, qzeros, scales (fp16)  |
| gptq-...       | quant_method gptq, bits 4, group_size, sym,        | qweight, qzeros, scales, g_idx  |
|                | desc_act, checkpoint_format gptq (zeros minus one) |                                 |
|                | or gptq_v2                                         |                                 |
| ct-w4a16-...   | compressed-tensors pack-quantized, int 4 bits,     | weight_packed [N, K/8],         |
|                | group (32/64/128) or channel, symmetric or not,    | weight_scale [N, G], weight_    |
|                | actorder null or "group" (llm-compressor "W4A16")  | shape [2]; weight_zero_point    |
|                |                                                    | [N/8, G] (asym), weight_g_idx   |

Every q/k/v/o/gate/up/down projection is quantized; embeddings, norms, biases and lm_head stay as
the source has them (`ignore: ["lm_head"]`). The canonical values come from
tokenmill.model.layers.quantize_weights; the packing into each layout and the dequantized reference
are written here, independently of the src unpacking code, so a test of that code against these
checkpoints can fail.

Sources (`QUANT_SOURCES`): tiny Llama / Qwen2 checkpoints written by transformers' save_pretrained,
hidden 128, 4 heads of 32, 2 KV heads (k/v have 64 output features), 2 layers: "llama" (intermediate
256: every group size 32/64/128 divides every K), "llama-bf16" (the same in bfloat16), and "qwen2"
(q/k/v bias, intermediate 192: partial 128x128 FP8 blocks along N and K, group sizes 32 and 64),
"llama-mha" (4 KV heads: every merged part a multiple of 128 rows, as the GPU's FP8 blocks need),
and the mixture-of-experts "qwen3-moe", "qwen2-moe" (a shared expert) and "mixtral" (4 experts of
intermediate 128, top-2, 4 KV heads; routers and the shared-expert gate unquantized).

Use the session fixture `quantized_checkpoint` (import it into the test module): a function
(layout, source="llama") -> QuantizedCheckpoint, written once per session. `corrupt_tensor` writes
a copy of a checkpoint with one tensor of the wrong shape, for bad-input tests.
"""

from __future__ import annotations

import json
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import write_tiny_checkpoint
from tokenmill.model.layers.quantize_weights import (
    quantize_fp8_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
    quantize_int4,
)

QUANTIZED_PROJECTIONS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "qkv_proj", "gate_up_proj",  # Phi-3's fused projections, quantized as one tensor each (as tools do)
)  # fmt: skip
# Mixtral's experts (block_sparse_moe.experts.E.w1 / w3 / w2) are quantized too; MoE routers
# (mlp.gate, block_sparse_moe.gate) and Qwen's shared_expert_gate stay as the source has them, as
# the published FP8 MoE checkpoints leave them.
MIXTRAL_EXPERT_PROJECTIONS = ("w1", "w2", "w3")
FP8_BLOCK = (128, 128)
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8c + AWQ_PACK_ORDER[i]

# One layer's float weight [N, K] and its name -> (the tensors that replace `<layer>.weight`, the
# dequantized weight as float32).
QuantizeLayer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]


@dataclass(frozen=True)
class QuantizedCheckpoint:
    path: Path  # the quantized checkpoint
    reference: Path  # float32 dequantized weights, no quantization_config: transformers' input
    layout: str
    layers: tuple[str, ...]  # the quantized linear layers, e.g. "model.layers.0.self_attn.q_proj"


# ------------------------------------------------------------------------------- packing (test side)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in 0..2^32-1 -> the int32 tensors with the same bits (checkpoints store int32)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, N] in 0..15 -> AWQ int32 [R, N/8]: word c's nibble i is column 8c + AWQ_PACK_ORDER[i]."""
    rows, n = values.shape
    grouped = values.to(torch.int64).view(rows, n // 8, 8)
    words = torch.zeros(rows, n // 8, dtype=torch.int64)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        words |= grouped[:, :, column] << (4 * nibble)
    return to_int32(words)


def pack_along_rows(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R/8, C], word r holding rows 8r..8r+7 in nibbles 0..7 (GPTQ qweight)."""
    rows, cols = values.shape
    grouped = values.to(torch.int64).view(rows // 8, 8, cols)
    words = torch.zeros(rows // 8, cols, dtype=torch.int64)
    for nibble in range(8):
        words |= grouped[:, nibble, :] << (4 * nibble)
    return to_int32(words)


def pack_along_columns(values: torch.Tensor) -> torch.Tensor:
    """uint8 [R, C] -> int32 [R, C/8], word c holding columns 8c..8c+7 in nibbles 0..7 (GPTQ qzeros)."""
    return pack_along_rows(values.t().contiguous()).t().contiguous()


# --------------------------------------------------------------------- dequantized reference weights


def reference_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """(q - zero) * scale per column's group, in float32 (exact: a 4-bit integer times a 16-bit scale)."""
    groups = g_idx.long()
    return (q.float() - zeros.float()[:, groups]) * scales.float()[:, groups]


def reference_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = weight.float()
    bn, bk = block
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] *= scale[i, j].float()
    return out


# --------------------------------------------------------------------------------- the layouts


def _fp8_layer(strategy: str, scale_dtype: torch.dtype, name: str, w: torch.Tensor):
    if strategy == "tensor":
        weight, scale, _ = quantize_fp8_per_tensor(w)
        scale = scale.to(scale_dtype)  # [1]
        return {"weight": weight, "weight_scale": scale}, weight.float() * scale.float()
    if strategy == "channel":
        weight, scale, _ = quantize_fp8_per_channel(w)
        scale = scale.to(scale_dtype)[:, None]  # [N, 1]
        return {"weight": weight, "weight_scale": scale}, weight.float() * scale.float()
    weight, scale, _ = quantize_fp8_block(w, FP8_BLOCK)
    scale = scale.to(scale_dtype)
    return {"weight": weight, "weight_scale": scale}, reference_fp8_blocks(weight, scale, FP8_BLOCK)


def compressed_tensors_fp8_config(strategy: str, activations: str) -> dict:
    """The quantization_config llm-compressor writes for FP8 weights of `strategy` (tensor, channel,
    block) with `activations` "static" (per-tensor input_scale) or "dynamic" (per token; per 1x128
    group for block weights), built with the compressed-tensors package's own models."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=8,
        type="float",
        symmetric=True,
        dynamic=False,
        strategy=strategy,
        block_structure=list(FP8_BLOCK) if strategy == "block" else None,
    )
    if activations == "static":
        inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=False, strategy="tensor")
    elif strategy == "block":
        inputs = QuantizationArgs(
            num_bits=8, type="float", symmetric=True, dynamic=True, strategy="group", group_size=FP8_BLOCK[1]
        )
    else:
        inputs = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="token")
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="float-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    )
    return config.model_dump(mode="json")


def compressed_tensors_fp8(src: Path, dtype: torch.dtype, strategy: str, activations: str):
    """(quantization_config, QuantizeLayer) of the compressed-tensors FP8 layout. Scales are stored
    in the model's dtype, as compressed-tensors initializes them; a static input_scale is absmax / 448
    of the layer's inputs over a calibration prompt run through transformers."""
    input_absmax = calibrate_input_absmax(src) if activations == "static" else {}

    def quantize(name: str, w: torch.Tensor):
        tensors, deq = _fp8_layer(strategy, dtype, name, w)
        if activations == "static":
            # transformers holds MoE experts stacked (no per-expert module to hook): an expert
            # takes the largest input absmax recorded (the engine checks static scales, never uses them).
            absmax = input_absmax[name] if name in input_absmax else max(input_absmax.values())
            tensors["input_scale"] = (absmax / 448.0).reshape(1).to(dtype)
        return tensors, deq

    return compressed_tensors_fp8_config(strategy, activations), quantize


def hf_fp8(src: Path, dtype: torch.dtype):
    """Hugging Face `fp8` (DeepSeek-V3 / Qwen3-FP8 style): 128x128 blocks, float32 weight_scale_inv,
    which despite its name multiplies: W = weight * weight_scale_inv."""
    config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(FP8_BLOCK),
    }

    def quantize(name: str, w: torch.Tensor):
        weight, scale, _ = quantize_fp8_block(w, FP8_BLOCK)
        return {"weight": weight, "weight_scale_inv": scale}, reference_fp8_blocks(weight, scale, FP8_BLOCK)

    return config, quantize


def awq(src: Path, dtype: torch.dtype, group_size: int):
    """AutoAWQ's "gemm" layout: qweight [K, N/8], qzeros [K/G, N/8] (AWQ nibble order), fp16 scales
    [K/G, N]; asymmetric (zero_point true)."""
    config = {
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "modules_to_not_convert": None,
    }

    def quantize(name: str, w: torch.Tensor):
        if w.shape[1] % group_size:
            raise ValueError(
                f"AWQ needs {name}'s in_features ({w.shape[1]}) to be a multiple of {group_size}"
            )
        q, scales, zeros, _, g_idx = quantize_int4(w, group_size, symmetric=False)
        tensors = {
            "qweight": pack_awq(q.t().contiguous()),
            "qzeros": pack_awq(zeros.t().contiguous()),
            "scales": scales.t().contiguous(),
        }
        return tensors, reference_int4(q, scales, zeros, g_idx)

    return config, quantize


def act_order_g_idx(k: int, group_size: int, seed: int) -> torch.Tensor:
    """The g_idx act-order writes: the columns were quantized in a shuffled order `perm` (GPTQ sorts
    them by Hessian diagonal), in groups of that order, so column perm[i] is in group i // group_size."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // group_size).to(torch.int32)
    return g_idx


def _shared_input(name: str) -> str:
    """GPTQ orders columns by its Hessian, which comes from the layer's input: projections that read
    one input (q/k/v; gate/up) get one order, seeded by this name."""
    return name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")


def gptq(src: Path, dtype: torch.dtype, group_size: int, sym: bool, desc_act: bool, checkpoint_format: str):
    """GPTQ (AutoGPTQ / GPTQModel): qweight [K/8, N] packed along K, qzeros [G, N/8] packed along N
    (minus one in checkpoint_format "gptq", as they are in "gptq_v2"), fp16 scales [G, N], g_idx [K]
    (shuffled with desc_act). A v1 zero of 0 is stored as the nibble 15 (masked, so that it cannot
    spill into the next nibble as AutoGPTQ's unmasked -1 did)."""
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "static_groups": False,
        "true_sequential": True,
        "damp_percent": 0.01,
        "checkpoint_format": checkpoint_format,
    }
    zeros_stored_minus = {"gptq": 1, "gptq_v2": 0}[checkpoint_format]

    def quantize(name: str, w: torch.Tensor):
        k = w.shape[1]
        g_idx = act_order_g_idx(k, group_size, zlib.crc32(_shared_input(name).encode())) if desc_act else None
        q, scales, zeros, _, g_idx = quantize_int4(w, group_size, symmetric=sym, g_idx=g_idx)
        stored_zeros = ((zeros.to(torch.int64) - zeros_stored_minus) & 0xF).to(torch.uint8)
        tensors = {
            "qweight": pack_along_rows(q.t().contiguous()),
            "qzeros": pack_along_columns(stored_zeros.t().contiguous()),
            "scales": scales.t().contiguous(),
            "g_idx": g_idx,
        }
        return tensors, reference_int4(q, scales, zeros, g_idx)

    return config, quantize


def compressed_tensors_w4a16_config(group_size: int, symmetric: bool, actorder: str | None) -> dict:
    """The quantization_config llm-compressor writes for 4-bit integer weights (group_size -1: the
    "channel" strategy), built with the compressed-tensors package's own models. compressed-tensors
    0.20 no longer accepts actorder "group" (older versions wrote it, with a weight_g_idx per layer,
    and such checkpoints are on the Hub): it is set in the dumped config."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    weights = QuantizationArgs(
        num_bits=4,
        type="int",
        symmetric=symmetric,
        dynamic=False,
        strategy="channel" if group_size == -1 else "group",
        group_size=None if group_size == -1 else group_size,
        actorder=None if actorder == "group" else actorder,
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=["lm_head"],
    ).model_dump(mode="json")
    if actorder == "group":
        config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    return config


def compressed_tensors_w4a16(src: Path, dtype: torch.dtype, group_size: int, symmetric: bool, actorder: str | None):
    """llm-compressor's W4A16 (`pack-quantized`): the signed 4-bit values (q - 8) packed along K by
    compressed-tensors' own `pack_to_int32`, scales [N, G] in the model's dtype, weight_shape [N, K],
    and for asymmetric weights the signed zero points (zero - 8) packed along N; actorder "group"
    adds weight_g_idx (one order for the projections that read one input, as GPTQ's Hessian gives)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    config = compressed_tensors_w4a16_config(group_size, symmetric, actorder)

    def quantize(name: str, w: torch.Tensor):
        k = w.shape[1]
        groups = k if group_size == -1 else group_size
        g_idx = act_order_g_idx(k, groups, zlib.crc32(_shared_input(name).encode())) if actorder == "group" else None
        q, scales, zeros, _, g_idx = quantize_int4(w, groups, symmetric=symmetric, g_idx=g_idx, scale_dtype=dtype)
        tensors = {
            "weight_packed": pack_to_int32((q.to(torch.int16) - 8).to(torch.int8), 4),
            "weight_scale": scales,
            "weight_shape": torch.tensor(w.shape),
        }
        if not symmetric:
            tensors["weight_zero_point"] = pack_to_int32((zeros.to(torch.int16) - 8).to(torch.int8), 4, packed_dim=0)
        if actorder == "group":
            tensors["weight_g_idx"] = g_idx
        return tensors, reference_int4(q, scales, zeros, g_idx)

    return config, quantize


# layout name -> (src dir, the source's float dtype) -> (quantization_config, QuantizeLayer)
QUANT_LAYOUTS: dict[str, Callable] = {
    "ct-fp8-tensor": partial(compressed_tensors_fp8, strategy="tensor", activations="static"),
    "ct-fp8-tensor-dynamic": partial(compressed_tensors_fp8, strategy="tensor", activations="dynamic"),
    "ct-fp8-channel": partial(compressed_tensors_fp8, strategy="channel", activations="dynamic"),
    "ct-fp8-block": partial(compressed_tensors_fp8, strategy="block", activations="dynamic"),
    "hf-fp8-block": hf_fp8,
    "awq-g128": partial(awq, group_size=128),
    "awq-g32": partial(awq, group_size=32),
    "gptq-g128-sym": partial(gptq, group_size=128, sym=True, desc_act=False, checkpoint_format="gptq"),
    "gptq-g32-asym": partial(gptq, group_size=32, sym=False, desc_act=False, checkpoint_format="gptq"),
    "gptq-g32-sym-actorder": partial(gptq, group_size=32, sym=True, desc_act=True, checkpoint_format="gptq"),
    "gptq-g64-asym-actorder": partial(
        gptq, group_size=64, sym=False, desc_act=True, checkpoint_format="gptq"
    ),
    "gptq-v2-g32-asym": partial(gptq, group_size=32, sym=False, desc_act=False, checkpoint_format="gptq_v2"),
    "ct-w4a16-g128-sym": partial(compressed_tensors_w4a16, group_size=128, symmetric=True, actorder=None),
    "ct-w4a16-g32-asym": partial(compressed_tensors_w4a16, group_size=32, symmetric=False, actorder="weight"),
    "ct-w4a16-g64-asym-actorder": partial(compressed_tensors_w4a16, group_size=64, symmetric=False, actorder="group"),
    "ct-w4a16-channel-sym": partial(compressed_tensors_w4a16, group_size=-1, symmetric=True, actorder=None),
}
FP8_LAYOUTS = [name for name in QUANT_LAYOUTS if "fp8" in name]
INT4_LAYOUTS = [name for name in QUANT_LAYOUTS if "fp8" not in name]


# ------------------------------------------------------------------------------------ the writer


def read_checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _is_quantized(name: str) -> bool:
    layer, _, leaf = name.rpartition(".")
    projection = layer.rpartition(".")[2]
    return leaf == "weight" and (
        projection in QUANTIZED_PROJECTIONS or (projection in MIXTRAL_EXPERT_PROJECTIONS and ".experts." in layer)
    )


def _copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer, generation config, ...: everything but the weights and config.json."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if (
            file.is_file()
            and file.suffix != ".safetensors"
            and file.name not in ("config.json", "model.safetensors.index.json")
        ):
            shutil.copy(file, dst / file.name)


def _source_dtype(config: dict) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, name)


def write_quantized_checkpoint(src: Path, dst: Path, reference: Path, layout: str) -> QuantizedCheckpoint:
    """Write `src` (a save_pretrained directory) quantized in `layout` to `dst`, and its dequantized
    float32 reference to `reference`."""
    config = json.loads((src / "config.json").read_text())
    dtype = _source_dtype(config)
    quant_config, quantize = QUANT_LAYOUTS[layout](src, dtype)
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    layers = []
    for name, tensor in sorted(read_checkpoint_tensors(src).items()):
        if not _is_quantized(name):
            quantized[name] = tensor
            dequantized[name] = tensor.float()
            continue
        layer = name.rpartition(".")[0]
        tensors, deq = quantize(layer, tensor.float())
        quantized.update({f"{layer}.{leaf}": t.contiguous() for leaf, t in tensors.items()})
        dequantized[name] = deq
        layers.append(layer)
    for out, tensors, out_config in (
        (dst, quantized, {**config, "quantization_config": quant_config}),
        (reference, dequantized, _float32_config(config)),
    ):
        _copy_side_files(src, out)
        (out / "config.json").write_text(json.dumps(out_config, indent=2))
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return QuantizedCheckpoint(dst, reference, layout, tuple(layers))


def _float32_config(config: dict) -> dict:
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    for key in ("dtype", "torch_dtype"):
        if key in out:
            out[key] = "float32"
    return out


def calibrate_input_absmax(src: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """The largest |input| of each quantized linear layer of `src` over one random 24-token prompt,
    run through transformers (what a static-activation calibration pass records)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    absmax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in QUANTIZED_PROJECTIONS:

            def record(module, args, name=name):
                seen = args[0].detach().abs().amax().float()
                absmax[name] = torch.maximum(absmax.get(name, seen), seen)

            hooks.append(module.register_forward_pre_hook(record))
    ids = torch.randint(3, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return absmax


def corrupt_tensor(
    src: Path, dst: Path, name: str, wrong: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[Path, list[int], list[int]]:
    """Copy checkpoint `src` to `dst` with tensor `name` replaced by `wrong(tensor)` (default: one
    extra row, e.g. a scale or packed tensor that disagrees with the config). Returns (dst, the
    right shape, the written shape)."""
    tensors = read_checkpoint_tensors(src)
    if name not in tensors:
        raise KeyError(f"{src} has no tensor {name!r}")
    right = tensors[name]
    bad = wrong(right) if wrong is not None else torch.cat([right, right[:1]])
    tensors[name] = bad.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    _copy_side_files(src, dst)
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, list(right.shape), list(bad.shape)


# ---------------------------------------------------------------------------------- the fixtures

_SOURCE_SHAPE = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=2
)
# source name -> (family, seed, overrides, dtype it is saved in)
QUANT_SOURCES: dict[str, tuple[str, int, dict, torch.dtype]] = {
    "llama": ("llama", 31, dict(_SOURCE_SHAPE, intermediate_size=256), torch.float32),
    "llama-bf16": ("llama", 31, dict(_SOURCE_SHAPE, intermediate_size=256), torch.bfloat16),
    "qwen2": ("qwen2", 32, dict(_SOURCE_SHAPE, intermediate_size=192), torch.float32),
    # 4 KV heads: q, k and v each 128 rows, so 128x128 FP8 blocks tile the merged q/k/v (the GPU
    # kernels need that; real models' parts are multiples of 128).
    "llama-mha": ("llama", 33, dict(_SOURCE_SHAPE, num_key_value_heads=4, intermediate_size=256), torch.float32),
    # Mixture-of-experts sources (experts stored one tensor per expert, as published): expert
    # intermediate sizes of 128, so 128x128 FP8 blocks tile each expert's gate and up, and 4 KV
    # heads, so they tile q/k/v too (the GPU's block kernels need both).
    "qwen3-moe": (
        "qwen3_moe", 34,
        dict(_SOURCE_SHAPE, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=128,
             intermediate_size=256),
        torch.float32,
    ),
    "qwen2-moe": (
        "qwen2_moe", 35,
        dict(_SOURCE_SHAPE, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, moe_intermediate_size=128,
             shared_expert_intermediate_size=128, intermediate_size=256),
        torch.float32,
    ),
    "mixtral": (
        "mixtral", 36,
        dict(_SOURCE_SHAPE, num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2, intermediate_size=128, sliding_window=None),
        torch.float32,
    ),
}  # fmt: skip
MOE_SOURCES = ("qwen3-moe", "qwen2-moe", "mixtral")
# Gemma 2 / Gemma 3 text (tests/engine/gemma_checkpoints.py: soft caps, sliding windows, Q/K norms,
# tied embeddings) at the shape above: head_dim 32, intermediate 256.
GEMMA_SOURCES = {
    "gemma2": ("gemma2", 37, dict(hidden_size=128, head_dim=32, intermediate_size=256, num_hidden_layers=2)),
    "gemma3": ("gemma3", 38, dict(hidden_size=128, head_dim=32, intermediate_size=256, num_hidden_layers=4)),
}


def write_quant_source(path: Path, source: str, tokenizer) -> Path:
    """A tiny checkpoint to quantize, written by transformers' save_pretrained."""
    from transformers import AutoModelForCausalLM

    if source == "phi3":
        return _write_phi3_source(path, tokenizer)

    if source in GEMMA_SOURCES:
        from tests.engine.gemma_checkpoints import write_gemma_checkpoint

        family, seed, overrides = GEMMA_SOURCES[source]
        return write_gemma_checkpoint(path, family, tokenizer, seed, **overrides)
    family, seed, overrides, dtype = QUANT_SOURCES[source]
    if source in MOE_SOURCES:
        from tests.moe_checkpoints import write_tiny_moe_checkpoint

        return write_tiny_moe_checkpoint(path, family, tokenizer, seed, **overrides)
    if dtype == torch.float32:
        return write_tiny_checkpoint(path, family, tokenizer, seed, **overrides)
    fp32 = write_tiny_checkpoint(path.with_name(path.name + "-fp32"), family, tokenizer, seed, **overrides)
    AutoModelForCausalLM.from_pretrained(fp32, dtype=dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def quantized_checkpoint(tmp_path_factory, tiny_tokenizer) -> Callable[..., QuantizedCheckpoint]:
    """(layout, source="llama") -> QuantizedCheckpoint, each written once per session."""
    sources: dict[str, Path] = {}
    written: dict[tuple[str, str], QuantizedCheckpoint] = {}

    def get(layout: str, source: str = "llama") -> QuantizedCheckpoint:
        if (layout, source) not in written:
            if source not in sources:
                sources[source] = write_quant_source(
                    tmp_path_factory.mktemp(f"src-{source}"), source, tiny_tokenizer
                )
            root = tmp_path_factory.mktemp(f"{layout}-{source}")
            written[layout, source] = write_quantized_checkpoint(
                sources[source], root / "quantized", root / "reference", layout
            )
        return written[layout, source]

    return get


def _write_phi3_source(path: Path, tokenizer) -> Path:
    """Phi-3 (fused qkv_proj and gate_up_proj tensors) at the shape above with 4 KV heads, so each
    fused part (q, k, v: 128 rows; gate, up: 256) holds whole 128-row FP8 blocks, as Phi-3's do."""
    import transformers

    from tests.conftest import _randomize

    config = transformers.Phi3Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-6,
        sliding_window=None, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(39)
    model = transformers.Phi3ForCausalLM(config).to(torch.float32).eval()
    _randomize(model, 39)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
