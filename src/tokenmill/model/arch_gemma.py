"""Gemma 2 and Gemma 3 (text) `config.json` files -> ArchConfig.

Gemma's configs name things their own way (`hidden_activation`, `query_pre_attn_scalar`, soft
caps, `layer_types` / `sliding_window_pattern`, Gemma 3's per-layer-type RoPE) and a
`Gemma3ForConditionalGeneration` checkpoint keeps its text model's settings in a sparse
`text_config` that relies on transformers' defaults. The defaults below are those of
transformers' Gemma2Config and Gemma3TextConfig (importing transformers here would pull torch
into the API server process).
"""

from __future__ import annotations

from typing import Any

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.arch import ArchConfig, _as_id_tuple, _rope

_GEMMA2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "rope_theta": 10000.0,
    "sliding_window_pattern": 2,  # transformers: layers 0, 2, 4, ... slide
}
_GEMMA3_DEFAULTS: dict[str, Any] = {
    **_GEMMA2_DEFAULTS,
    "vocab_size": 262208,
    "max_position_embeddings": 131072,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "rope_theta": 1_000_000.0,  # the full-attention layers'
    "rope_local_base_freq": 10_000.0,  # the sliding-window layers'
    "sliding_window_pattern": 6,  # every sixth layer attends globally
}
SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
_SLIDING, _FULL = "sliding_attention", "full_attention"


def gemma_arch_config(cfg: dict[str, Any], family: str) -> ArchConfig:
    """ArchConfig of a Gemma2ForCausalLM, Gemma3ForCausalLM or Gemma3ForConditionalGeneration
    config (the latter's text model); UnsupportedModelError for what the Gemma model cannot run."""
    text = _text_config(cfg)
    defaults = _GEMMA2_DEFAULTS if family == "gemma2" else _GEMMA3_DEFAULTS
    # Keys the config leaves out (or null) take transformers' defaults; only the soft caps and the
    # window read an explicit null as "none" (below).
    settings = {**defaults, **{k: v for k, v in text.items() if v is not None}}

    def nullable(key: str) -> Any:
        return text[key] if key in text else defaults[key]

    hidden_size = int(settings["hidden_size"])
    num_heads = int(settings["num_attention_heads"])
    num_kv_heads = int(settings["num_key_value_heads"])
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    activation = text.get("hidden_activation") or text.get("hidden_act") or defaults["hidden_activation"]
    if activation not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{family} hidden_activation {activation!r} is not supported; expected 'gelu_pytorch_tanh'"
        )
    if text.get("use_bidirectional_attention"):
        raise UnsupportedModelError(
            "use_bidirectional_attention=true (an embedding model) is not supported; expected a causal "
            "language model"
        )
    num_layers = int(settings["num_hidden_layers"])
    max_positions = int(settings["max_position_embeddings"])
    rope_theta, rope_scaling, local_theta, local_scaling = _gemma_rope(text, family, settings)
    final_cap = nullable("final_logit_softcapping")
    # transformers' Gemma 3 attention never applies attn_logit_softcapping (its configs set none).
    attn_cap = nullable("attn_logit_softcapping") if family == "gemma2" else None
    bias = bool(text.get("attention_bias", False))
    return ArchConfig(
        architecture=family,
        vocab_size=int(settings["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(settings["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(settings["head_dim"]),
        rms_norm_eps=float(settings["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bias,
        o_proj_bias=bias,
        qk_norm=family == "gemma3",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", settings["tie_word_embeddings"])),
        max_position_embeddings=max_positions,
        sliding_windows=_sliding_windows(
            nullable("sliding_window"),
            layer_types(text, num_layers, int(settings["sliding_window_pattern"])),
            max_positions,
        ),
        bos_token_id=cfg.get("bos_token_id", text.get("bos_token_id")),
        eos_token_ids=_as_id_tuple(cfg.get("eos_token_id", text.get("eos_token_id"))),
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(settings["query_pre_attn_scalar"]),
        attn_logit_softcap=float(attn_cap) if attn_cap is not None else None,
        final_logit_softcap=float(final_cap) if final_cap is not None else None,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
    )


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's settings: a Gemma3ForConditionalGeneration config nests them."""
    text = cfg.get("text_config")
    if text is None:
        return cfg
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise UnsupportedModelError(
            f"text_config.model_type {text.get('model_type')!r} is not supported; expected 'gemma3_text'"
        )
    return text


def layer_types(text: dict[str, Any], num_layers: int, pattern: int) -> list[str]:
    """Each layer's attention type: `layer_types` when given, else transformers' rule (every
    `sliding_window_pattern`-th layer full, the others sliding)."""
    types = text.get("layer_types")
    if types is None:
        return [_FULL if (i + 1) % pattern == 0 else _SLIDING for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {_SLIDING, _FULL}:
        raise UnsupportedModelError(
            f"layer_types must list {num_layers} entries of {_SLIDING!r} / {_FULL!r}, got {types}"
        )
    return list(types)


def _sliding_windows(window: int | None, types: list[str], max_positions: int) -> tuple[int | None, ...]:
    """Each layer's window: the sliding layers' even where it covers every position (the model
    then attends plainly, see GemmaCausalLM) or is null (transformers then masks nothing: a
    window of max_position_embeddings), since a layer's type also picks Gemma 3's RoPE table."""
    if _SLIDING not in types:
        return ()
    size = int(window) if window is not None else max_positions
    return tuple(size if t == _SLIDING else None for t in types)


def _gemma_rope(
    text: dict[str, Any], family: str, settings: dict[str, Any]
) -> tuple[float, dict[str, Any] | None, float | None, dict[str, Any] | None]:
    """(theta, scaling) of the full-attention layers and, for Gemma 3, of the sliding ones.

    transformers 5 writes Gemma 3's RoPE as `rope_parameters` keyed by layer type; older configs
    have `rope_theta` + `rope_scaling` (the full-attention layers') and `rope_local_base_freq`.
    """
    if family == "gemma2":
        theta, scaling = _rope_table(text)  # one table for every layer; the default theta is Gemma 2's
        return theta, scaling, None, None
    params = text.get("rope_parameters")
    if isinstance(params, dict) and _FULL in params:
        full = {"rope_theta": settings["rope_theta"], **(params[_FULL] or {})}
        local = {"rope_theta": settings["rope_local_base_freq"], **(params.get(_SLIDING) or {})}
        theta, scaling = _rope_table({"rope_parameters": full})
        local_theta, local_scaling = _rope_table({"rope_parameters": local})
    else:
        theta, scaling = _rope_table(
            {"rope_theta": settings["rope_theta"], "rope_scaling": text.get("rope_scaling")}
        )
        local_theta, local_scaling = _rope_table({"rope_theta": settings["rope_local_base_freq"]})
    if (local_theta, local_scaling) == (theta, scaling):
        return theta, scaling, None, None
    return theta, scaling, local_theta, local_scaling


def _rope_table(params: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one RoPE table, parsed as arch.py parses every family's."""
    theta, scaling, _, _ = _rope(params, "gemma")
    return theta, scaling
