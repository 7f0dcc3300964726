"""GGUF files (llama.cpp): metadata -> ArchConfig, tensors dequantized at load to HF names.

llama.cpp's converter permutes the Q and K rows of llama-family models (it uses interleaved
RoPE, HF uses rotate-half); we undo that here exactly as transformers' GGUF loader does, so
both produce the same model from the same file. Qwen2/Qwen3 files are not permuted. Gemma files
store each RMSNorm weight as 1 + w; it is loaded as the checkpoint's w (gguf_families).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader.gguf_families import CONFIG_TENSORS, FAMILIES, GLOBAL_TENSORS, GGUFFamily
from tokenmill.model.loader.gguf_metadata import (  # noqa: F401  (re-exported: older import paths)
    GGUF_ARCHITECTURES,
    ROPE_FREQS_TENSOR,
    gguf_arch_config,
    gguf_hf_config,
    gguf_metadata,
    open_gguf,
)

logger = logging.getLogger(__name__)

_BLOCK_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<tensor>\w+)\.(?P<kind>weight|bias)")


def hf_name_for(gguf_name: str, family: GGUFFamily = FAMILIES["llama"]) -> str | None:
    """HF tensor name for a GGUF one; None for tensors folded into the config (rope_freqs)."""
    if gguf_name in CONFIG_TENSORS:
        return None
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match["tensor"] not in family.block_tensors:
        raise UnsupportedModelError(
            f"unexpected GGUF tensor {gguf_name!r}; this model family is not supported"
        )
    return f"model.layers.{match['layer']}.{family.block_tensors[match['tensor']]}.{match['kind']}"


def _family(path: str | Path) -> GGUFFamily:
    return FAMILIES[gguf_metadata(path, "general.architecture")]


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of Q/K rows (interleaved pairs -> rotate-half halves), per head."""
    half_rows = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, half_rows, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _unpermute_if_qk(rows: np.ndarray, hf_name: str, arch: ArchConfig) -> np.ndarray:
    """A permuted file's Q or K weight / bias rows back in HF order; any other tensor as it is."""
    if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_qk(rows, arch.num_heads)
    if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_qk(rows, arch.num_kv_heads)
    return rows


def iter_gguf_weights(
    path: str | Path,
    arch: ArchConfig,
    requantized: dict[str, np.ndarray] | None = None,
    skip: frozenset[str] | set[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 CPU tensor) for every tensor but those named in `skip` (HF names: weights
    the model takes as blocks only), dequantized one at a time. With `requantized`, the Q8_0 rows of
    each matmul weight of a REQUANTIZED_TYPES type go there too (by GGUF name, for
    iter_gguf_quantized), from the same dequantization: dequantizing a K-quant costs more than the
    requantization."""
    gguf_file = open_gguf(str(path))
    family = _family(path)
    for tensor in gguf_file.tensors:
        hf_name = hf_name_for(tensor.name, family)
        if hf_name is None or hf_name in skip:
            continue
        weight = gguf_file.dequantize(tensor)
        if requantized is not None and _requantizes(tensor, hf_name):
            requantized[tensor.name] = requantize_q8_0(weight)
        if family.permuted_qk:
            weight = _unpermute_if_qk(weight, hf_name, arch)
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if family.norms_stored_plus_one and hf_name.endswith("norm.weight"):
            weight = weight - np.float32(1.0)  # a new array: the memory map stays untouched
        if not weight.flags.writeable:  # F32 tensors come straight from the read-only memory map
            weight = weight.copy()
        yield hf_name, torch.from_numpy(weight)


# GGML types the CPU's quant_gemv kernel reads (kernels/cpu/csrc/cpu_quant_gemv.cpp): type id -> kernel code.
QUANT_GEMV_TYPES = {3: 0, 8: 1}  # Q4_1, Q8_0
Q8_0_TYPE, Q8_0_BLOCK = 8, 32
Q8_0_CODE = QUANT_GEMV_TYPES[Q8_0_TYPE]
# Block types the kernels do not read, requantized to Q8_0 at load so that their matmuls read blocks
# too (8.5 bits a weight) instead of the float32 copy (32): Q4_0, Q5_0, Q5_1 and the K-quants Q2_K-Q6_K
# (a Q4_K_M file holds Q4_K and Q6_K). Q8_0's step is a 32-weight block's largest |w| / 127, so
# requantizing adds at most half of it, ~0.4 % of the block's largest weight; the formats' own steps
# are 4-16x coarser. llama.cpp reads these types directly; our kernels would need one per type.
REQUANTIZED_TYPES = frozenset({2, 6, 7, 10, 11, 12, 13, 14})
_MATMUL_SUFFIXES = tuple(
    f"{part}.weight"
    for part in (
        "q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj",
    )
) + ("lm_head.weight", "embed_tokens.weight")  # fmt: skip


def iter_gguf_quantized(
    path: str | Path, arch: ArchConfig, requantized: dict[str, np.ndarray] | None = None
) -> Iterator[tuple[str, int, np.ndarray]]:
    """(HF name, quant_gemv code, uint8 block rows [out, row_bytes]) for every matmul weight (and the
    embedding table, a tied lm_head's weight) stored in blocks: Q4_1 and Q8_0 as views of the file's
    memory map, the REQUANTIZED_TYPES as new Q8_0 rows (taken from `requantized`, which
    iter_gguf_weights filled, where it holds them); rows un-permuted like iter_gguf_weights
    un-permutes the dequantized Q/K."""
    made = {} if requantized is None else requantized
    gguf_file = open_gguf(str(path))
    family = _family(path)
    requantized_types: dict[str, int] = {}
    for tensor in gguf_file.tensors:
        hf_name = hf_name_for(tensor.name, family)
        if hf_name is None or not hf_name.endswith(_MATMUL_SUFFIXES):
            continue
        if tensor.ggml_type in QUANT_GEMV_TYPES:
            code, rows = QUANT_GEMV_TYPES[tensor.ggml_type], gguf_file.raw(tensor)
        elif _requantizes(tensor, hf_name):
            rows = made.pop(tensor.name, None)
            code, rows = Q8_0_CODE, requantize_q8_0(gguf_file.dequantize(tensor)) if rows is None else rows
            type_name = _type_name(tensor.ggml_type)
            requantized_types[type_name] = requantized_types.get(type_name, 0) + 1
        else:
            continue
        if family.permuted_qk:  # whole rows move, so the quantized blocks un-permute like the floats
            rows = _unpermute_if_qk(rows, hf_name, arch)
        yield hf_name, code, rows
    if requantized_types:
        counts = ", ".join(f"{n} {name}" for name, n in sorted(requantized_types.items()))
        logger.info("requantized %s matmul weights to Q8_0 blocks (the CPU kernels read Q4_1 and Q8_0)", counts)


def _requantizes(tensor, hf_name: str) -> bool:
    return (
        tensor.ggml_type in REQUANTIZED_TYPES
        and tensor.shape[-1] % Q8_0_BLOCK == 0
        and hf_name.endswith(_MATMUL_SUFFIXES)
    )


def _type_name(ggml_type: int) -> str:
    from gguf.constants import GGMLQuantizationType

    return GGMLQuantizationType(ggml_type).name


def requantize_q8_0(weights: np.ndarray) -> np.ndarray:
    """float32 rows [out, in] (in a multiple of 32) as GGML Q8_0 block rows [out, in / 32 * 34]: per
    32 weights a float16 scale d = max|w| / 127, then 32 int8 round(w / d). In torch, a few times
    faster than gguf's numpy quantizer (loading a 3B model's weights this way takes a while already)."""
    array = np.ascontiguousarray(weights, dtype=np.float32)
    if not array.flags.writeable:  # an F32 view of the file's memory map; torch wants writable memory
        array = array.copy()
    w = torch.from_numpy(array)
    out_features, in_features = w.shape
    blocks = w.reshape(out_features, in_features // Q8_0_BLOCK, Q8_0_BLOCK)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    scale16 = scale.to(torch.float16)
    # Divide by the float16 scale the kernel multiplies by, so the rounding is to its grid.
    inverse = torch.where(scale16 > 0, 1.0 / scale16.float(), torch.zeros_like(scale))
    quantized = (blocks * inverse).round_().clamp_(-127, 127).to(torch.int8)
    rows = torch.empty(out_features, in_features // Q8_0_BLOCK, 2 + Q8_0_BLOCK, dtype=torch.uint8)
    rows[..., :2] = scale16.view(torch.uint8)
    rows[..., 2:] = quantized.view(torch.uint8)
    return rows.reshape(out_features, -1).numpy()
