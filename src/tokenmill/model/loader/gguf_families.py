"""What each GGUF model family (llama.cpp's `general.architecture`) needs to become the HF model
it was converted from: its tensor names, what llama.cpp's converter changed in the tensors, and
the config settings its metadata keeps under other names or leaves to llama.cpp's code.

Torch-free: model resolution reads this in the API server process.

What llama.cpp's converter does that loading has to undo or restate:
- llama: Q/K rows permuted for its interleaved RoPE (undone in gguf_loader).
- gemma2 / gemma3: every RMSNorm weight stored as 1 + w (transformers' Gemma keeps w); no
  query_pre_attn_scalar in the file: llama.cpp's runtime takes head_dim, except for the 27B models
  (recognized by their layer count) where it takes hidden_size / num_heads, which is what their HF
  configs say; Gemma 3's local RoPE base (10,000) and its one-global-in-six layer pattern are
  llama.cpp constants (a file's own `attention.sliding_window_pattern` wins); the soft caps are
  Gemma 2 metadata keys.
- phi3: q, k, v and gate, up stay fused (`attn_qkv`, `ffn_up`), as in the HF checkpoint; LongRoPE's
  per-frequency factors are the tensors `rope_factors_long` / `rope_factors_short`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Metadata of one family: `meta("embedding_length")` reads "{arch}.embedding_length".
Meta = Callable[..., Any]

ROPE_FREQS_TENSOR = "rope_freqs.weight"  # Llama 3's RoPE scaling as per-frequency divisors
ROPE_FACTORS_LONG = "rope_factors_long.weight"  # Phi-3's LongRoPE factors
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
# Global tensors folded into the config (or not needed), never loaded as weights.
CONFIG_TENSORS = frozenset({ROPE_FREQS_TENSOR, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT})

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_BLOCK_TENSORS = {
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
# Gemma's four norms a layer: llama.cpp's `ffn_norm` is Gemma's pre-feed-forward norm, not Llama's
# post-attention one.
_GEMMA_BLOCK_TENSORS = {
    **_LLAMA_BLOCK_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",  # gate rows, then up rows, as Phi-3's checkpoint holds them
    "ffn_down": "mlp.down_proj",
}


@dataclass(frozen=True)
class GGUFFamily:
    hf_architecture: str
    block_tensors: Mapping[str, str]
    permuted_qk: bool = False  # llama.cpp permuted the Q/K rows (interleaved RoPE)
    norms_stored_plus_one: bool = False  # llama.cpp stored each RMSNorm weight w as 1 + w
    # (meta, the file's tensor names, the config so far) -> settings to add to the HF config
    config: Callable[[Meta, set[str], dict[str, Any]], dict[str, Any]] = field(default=lambda *_: {})


def _gemma_scalar(meta: Meta, cfg: dict[str, Any], layers_of_27b: int) -> float:
    """Gemma's query_pre_attn_scalar as llama.cpp's runtime picks it (the file does not say)."""
    if cfg["num_hidden_layers"] == layers_of_27b:
        return cfg["hidden_size"] / cfg["num_attention_heads"]
    return float(cfg["head_dim"])


def _gemma2_config(meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    settings = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scalar(meta, cfg, layers_of_27b=46),
        # Absent keys mean no cap in llama.cpp: an explicit null keeps transformers' defaults out.
        "attn_logit_softcapping": meta("attn_logit_softcapping"),
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "sliding_window": meta("attention.sliding_window"),
        "sliding_window_pattern": 2,
    }
    settings.update(_window_pattern(meta, cfg["num_hidden_layers"]))
    return settings


def _gemma3_config(meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    settings = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _gemma_scalar(meta, cfg, layers_of_27b=62),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "sliding_window": meta("attention.sliding_window"),
        "sliding_window_pattern": 6,
        # The global layers' RoPE is the file's (freq_base and any scaling: Gemma 3 4B-27B's linear 8).
        "rope_local_base_freq": 10_000.0,
    }
    settings.update(_window_pattern(meta, cfg["num_hidden_layers"]))
    return settings


def _window_pattern(meta: Meta, num_layers: int) -> dict[str, Any]:
    """A file's own `attention.sliding_window_pattern` (newer converters write one): a period (every
    n-th layer global) or one flag a layer (true = sliding)."""
    pattern = meta("attention.sliding_window_pattern")
    if pattern is None:
        return {}
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            return {"layer_types": list(pattern)}  # refused by arch_gemma, naming the count
        return {"layer_types": ["sliding_attention" if flag else "full_attention" for flag in pattern]}
    return {"sliding_window_pattern": int(pattern)}


def _phi3_config(meta: Meta, names: set[str], cfg: dict[str, Any]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    original = meta("rope.scaling.original_context_length")
    if original is not None:
        settings["original_max_position_embeddings"] = int(original)
    return settings


FAMILIES: dict[str, GGUFFamily] = {
    "llama": GGUFFamily("LlamaForCausalLM", _LLAMA_BLOCK_TENSORS, permuted_qk=True),
    "qwen2": GGUFFamily("Qwen2ForCausalLM", _LLAMA_BLOCK_TENSORS),
    "qwen3": GGUFFamily("Qwen3ForCausalLM", _LLAMA_BLOCK_TENSORS),
    "gemma2": GGUFFamily("Gemma2ForCausalLM", _GEMMA_BLOCK_TENSORS, norms_stored_plus_one=True, config=_gemma2_config),
    "gemma3": GGUFFamily("Gemma3ForCausalLM", _GEMMA_BLOCK_TENSORS, norms_stored_plus_one=True, config=_gemma3_config),
    "phi3": GGUFFamily("Phi3ForCausalLM", _PHI3_BLOCK_TENSORS, config=_phi3_config),
}  # fmt: skip
