"""gpt-oss (`GptOssForCausalLM`) `config.json` files -> ArchConfig.

gpt-oss is a Llama-shaped decoder with: q/k/v/o biases, a learned attention sink per head,
sliding-window layers alternating with full ones (`layer_types`, transformers' default: even
layers slide), YaRN RoPE, and a mixture of experts in every layer whose router and experts carry
biases and whose experts use a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`). The defaults below
are transformers' GptOssConfig's (importing transformers here would pull torch into the API
server process).
"""

from __future__ import annotations

from typing import Any

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.arch import ArchConfig, _as_id_tuple, _rope
from tokenmill.model.moe_config import MoEConfig

_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "tie_word_embeddings": False,
}
# transformers' GptOssConfig.rope_parameters when the config names none.
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_SLIDING, _FULL = "sliding_attention", "full_attention"


def gpt_oss_arch_config(cfg: dict[str, Any]) -> ArchConfig:
    """ArchConfig of a GptOssForCausalLM config; UnsupportedModelError for what we cannot run."""
    settings = {**_DEFAULTS, **{k: v for k, v in cfg.items() if v is not None}}
    hidden_size = int(settings["hidden_size"])
    num_heads = int(settings["num_attention_heads"])
    num_kv_heads = int(settings["num_key_value_heads"])
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    num_layers = int(settings["num_hidden_layers"])
    rope_cfg = dict(cfg)
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        rope_cfg["rope_parameters"] = dict(_DEFAULT_ROPE)
    if not rope_cfg.get("rope_theta") and not (rope_cfg.get("rope_parameters") or {}).get("rope_theta"):
        rope_cfg["rope_theta"] = _DEFAULT_ROPE["rope_theta"]
    rope_cfg.setdefault("max_position_embeddings", settings["max_position_embeddings"])
    rope_theta, rope_scaling, _, max_positions = _rope(rope_cfg, "gpt_oss")
    num_experts = int(settings["num_local_experts"])
    top_k = int(settings["num_experts_per_tok"])
    if not 1 <= top_k <= num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok ({top_k}) must be between 1 and num_local_experts ({num_experts})"
        )
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=int(settings["intermediate_size"]),
        renormalize=True,  # softmax over the top-k logits: the top-k probabilities renormalized
        sparse_layers=tuple(range(num_layers)),
        weights_in_model_dtype=True,  # transformers softmaxes the top-k logits in their dtype
        biases=True,
        clamped_swiglu=(float(settings["swiglu_alpha"]), float(settings["swiglu_limit"])),
    )
    bias = bool(settings["attention_bias"])
    return ArchConfig(
        architecture="gpt_oss",
        vocab_size=int(settings["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=moe.expert_intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(settings["head_dim"]),
        rms_norm_eps=float(settings["rms_norm_eps"]),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        attention_bias=bias,
        o_proj_bias=bias,
        tie_word_embeddings=bool(settings["tie_word_embeddings"]),
        max_position_embeddings=max_positions,
        sliding_windows=_sliding_windows(cfg, settings, num_layers, max_positions),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
        moe=moe,
    )


def _sliding_windows(
    cfg: dict[str, Any], settings: dict[str, Any], num_layers: int, max_positions: int
) -> tuple[int | None, ...]:
    """Each layer's window: `layer_types` or transformers' default (layers 0, 2, 4, ... slide); a
    window covering every position is plain attention."""
    types = cfg.get("layer_types") or [_SLIDING if (i + 1) % 2 else _FULL for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {_SLIDING, _FULL}:
        raise UnsupportedModelError(
            f"layer_types must list {num_layers} entries of {_SLIDING!r} / {_FULL!r}, got {types}"
        )
    window = cfg.get("sliding_window", settings["sliding_window"])
    if window is None:
        return ()  # transformers then masks nothing beyond causality
    window = int(window)
    if window < 1:
        raise UnsupportedModelError(f"sliding_window={window} must be >= 1")
    windows = tuple(window if t == _SLIDING and window < max_positions else None for t in types)
    return windows if any(w is not None for w in windows) else ()
