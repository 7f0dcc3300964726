"""GGUF files (llama.cpp): metadata -> ArchConfig, tensors dequantized at load to HF names.

llama.cpp's converter permutes the Q and K rows of llama-family models (it uses interleaved
RoPE, HF uses rotate-half); we undo that here exactly as transformers' GGUF loader does, so
both produce the same model from the same file. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader.gguf_file import GGUFFile

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_PERMUTED_QK_ARCHITECTURES = ("llama",)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<tensor>\w+)\.(?P<kind>weight|bias)")
ROPE_FREQS_TENSOR = "rope_freqs.weight"


@functools.lru_cache(maxsize=4)
def open_gguf(path: str) -> GGUFFile:
    """The parsed header of a GGUF file (tensor data stays memory-mapped), cached per path."""
    return GGUFFile(path)


def gguf_metadata(path: str | Path, key: str, default: Any = None) -> Any:
    return open_gguf(str(path)).metadata.get(key, default)


def gguf_hf_config(path: str | Path) -> dict[str, Any]:
    """The GGUF metadata rewritten as an HF config.json dict."""
    gguf_file = open_gguf(str(path))
    arch = gguf_metadata(path, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def meta(key: str, default: Any = None) -> Any:
        return gguf_metadata(path, f"{arch}.{key}", default)

    tensor_names = {t.name for t in gguf_file.tensors}
    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope_dims = meta("rope.dimension_count")
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "vocab_size": int(meta("vocab_size", 0) or len(gguf_metadata(path, "tokenizer.ggml.tokens", []))),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": gguf_metadata(path, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf_metadata(path, "tokenizer.ggml.eos_token_id"),
        "attention_bias": "blk.0.attn_output.bias" in tensor_names,
    }
    if rope_dims is not None and int(rope_dims) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dims) / head_dim  # rejected by ArchConfig
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        cfg["rope_scaling"] = {"rope_type": scaling_type}  # rejected by ArchConfig
    elif ROPE_FREQS_TENSOR in tensor_names:
        factors = _tensor_array(path, ROPE_FREQS_TENSOR)
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    window = meta("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
        cfg["use_sliding_window"] = True
    return cfg


def gguf_arch_config(path: str | Path) -> ArchConfig:
    return ArchConfig.from_hf_config(gguf_hf_config(path))


def _tensor_array(path: str | Path, name: str) -> np.ndarray:
    gguf_file = open_gguf(str(path))
    return gguf_file.dequantize(next(t for t in gguf_file.tensors if t.name == name))


def hf_name_for(gguf_name: str) -> str | None:
    """HF tensor name for a GGUF one; None for tensors folded into the config (rope_freqs)."""
    if gguf_name == ROPE_FREQS_TENSOR:
        return None
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match["tensor"] not in _BLOCK_TENSORS:
        raise UnsupportedModelError(
            f"unexpected GGUF tensor {gguf_name!r}; this model family is not supported"
        )
    return f"model.layers.{match['layer']}.{_BLOCK_TENSORS[match['tensor']]}.{match['kind']}"


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


def iter_gguf_weights(path: str | Path, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 CPU tensor) for every tensor, dequantized one at a time."""
    gguf_file = open_gguf(str(path))
    permuted = gguf_metadata(path, "general.architecture") in _PERMUTED_QK_ARCHITECTURES
    for tensor in gguf_file.tensors:
        hf_name = hf_name_for(tensor.name)
        if hf_name is None:
            continue
        weight = gguf_file.dequantize(tensor)
        if permuted:
            weight = _unpermute_if_qk(weight, hf_name, arch)
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        if not weight.flags.writeable:  # F32 tensors come straight from the read-only memory map
            weight = weight.copy()
        yield hf_name, torch.from_numpy(weight)


# GGML types the CPU's quant_gemv kernel reads (kernels/cpu/csrc/cpu_quant_gemv.cpp): type id -> kernel code.
QUANT_GEMV_TYPES = {3: 0, 8: 1}  # Q4_1, Q8_0
_MATMUL_SUFFIXES = tuple(
    f"{part}.weight"
    for part in (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )
) + ("lm_head.weight", "embed_tokens.weight")  # fmt: skip


def iter_gguf_quantized(path: str | Path, arch: ArchConfig) -> Iterator[tuple[str, int, np.ndarray]]:
    """(HF name, quant_gemv code, uint8 block rows [out, row_bytes]) for every matmul weight (and the
    embedding table, a tied lm_head's weight) stored as Q4_1 or Q8_0; rows un-permuted like
    iter_gguf_weights un-permutes the dequantized Q/K. Views of the file's memory map, not copies."""
    gguf_file = open_gguf(str(path))
    permuted = gguf_metadata(path, "general.architecture") in _PERMUTED_QK_ARCHITECTURES
    for tensor in gguf_file.tensors:
        hf_name = hf_name_for(tensor.name)
        if (
            hf_name is None
            or tensor.ggml_type not in QUANT_GEMV_TYPES
            or not hf_name.endswith(_MATMUL_SUFFIXES)
        ):
            continue
        rows = gguf_file.raw(tensor)
        if permuted:  # whole rows move, so the quantized blocks un-permute like the floats
            rows = _unpermute_if_qk(rows, hf_name, arch)
        yield hf_name, QUANT_GEMV_TYPES[tensor.ggml_type], rows
