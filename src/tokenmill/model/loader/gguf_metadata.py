"""GGUF metadata (llama.cpp files) -> an HF-style config and an ArchConfig, without torch.

Model resolution reads this in the API server process, which never imports torch; the weights
themselves are read by gguf_loader in the engine process.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader.gguf_file import GGUFFile

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
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
    experts = meta("expert_count")
    if experts:  # llama.cpp writes Mixtral as "llama" with stacked expert tensors
        raise UnsupportedModelError(
            f"{path} is a mixture-of-experts GGUF ({arch}.expert_count = {experts}), which tokenmill does not "
            "load yet; load the model's Hugging Face checkpoint instead (mixture-of-experts models load from "
            "safetensors, quantized or not)"
        )
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
        # ArchConfig reads HF's rope scalings; llama.cpp's keys for them are not translated yet.
        raise UnsupportedModelError(
            f"GGUF rope scaling type {scaling_type!r} in {path} is not supported; expected none "
            "(or a rope_freqs tensor); load the Hugging Face checkpoint instead"
        )
    if ROPE_FREQS_TENSOR in tensor_names:
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
