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
from tokenmill.model.loader.gguf_families import (
    FAMILIES,
    ROPE_FACTORS_LONG,
    ROPE_FACTORS_SHORT,
    ROPE_FREQS_TENSOR,
)
from tokenmill.model.loader.gguf_file import GGUFFile

# GGUF `general.architecture` -> HF architecture name.
GGUF_ARCHITECTURES = {name: family.hf_architecture for name, family in FAMILIES.items()}
# Texts of the end-of-turn tokens chat models of these families emit (llama.cpp ends generation at
# them too): a GGUF has no generation_config.json to list them beside its one EOS id.
END_OF_TURN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>", "<|end|>")
_CONTROL_TOKEN_TYPES = (3, 4)  # tokenizer.ggml.token_type: control, user-defined


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
        "eos_token_id": _end_of_generation_ids(path),
        "attention_bias": "blk.0.attn_output.bias" in tensor_names,
    }
    if rope_dims is not None and int(rope_dims) != head_dim:
        cfg["partial_rotary_factor"] = int(rope_dims) / head_dim  # Phi-4-mini's; other families refuse it
    scaling_type = meta("rope.scaling.type")
    if scaling_type == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        # ArchConfig reads HF's rope scalings; llama.cpp's keys for the others are not translated yet.
        raise UnsupportedModelError(
            f"GGUF rope scaling type {scaling_type!r} in {path} is not supported; expected none or linear "
            "(or a rope_freqs tensor); load the Hugging Face checkpoint instead"
        )
    if ROPE_FREQS_TENSOR in tensor_names:
        factors = _tensor_array(path, ROPE_FREQS_TENSOR)
        cfg["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": factors.tolist()}
    if ROPE_FACTORS_LONG in tensor_names and ROPE_FACTORS_SHORT in tensor_names:
        cfg["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": _tensor_array(path, ROPE_FACTORS_LONG).tolist(),
            "short_factor": _tensor_array(path, ROPE_FACTORS_SHORT).tolist(),
        }
        attention_factor = meta("rope.scaling.attn_factor")
        if attention_factor is not None:
            cfg["rope_scaling"]["attention_factor"] = float(attention_factor)
    window = meta("attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
        cfg["use_sliding_window"] = True
    cfg.update(FAMILIES[arch].config(meta, tensor_names, cfg))
    return cfg


def gguf_arch_config(path: str | Path) -> ArchConfig:
    return ArchConfig.from_hf_config(gguf_hf_config(path))


def _tensor_array(path: str | Path, name: str) -> np.ndarray:
    gguf_file = open_gguf(str(path))
    return gguf_file.dequantize(next(t for t in gguf_file.tensors if t.name == name))


def _end_of_generation_ids(path: str | Path) -> list[int]:
    """The file's EOS id, its end-of-turn / end-of-message ids when it names them, and the control
    tokens whose text is a chat turn's end (END_OF_TURN_TEXTS): what llama.cpp stops at."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = gguf_metadata(path, key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = gguf_metadata(path, "tokenizer.ggml.tokens") or []
    types = gguf_metadata(path, "tokenizer.ggml.token_type") or []
    for text in END_OF_TURN_TEXTS:
        try:
            token_id = tokens.index(text)
        except ValueError:
            continue
        if token_id < len(types) and int(types[token_id]) in _CONTROL_TOKEN_TYPES and token_id not in ids:
            ids.append(token_id)
    return ids
