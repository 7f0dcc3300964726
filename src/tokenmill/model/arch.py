"""A normalized description of a decoder-only model, whatever file format it came from.

Hugging Face `config.json` files differ by family and by transformers version (`rope_scaling`
vs `rope_parameters`, implicit `head_dim`, ...). `ArchConfig.from_hf_config` reads all of
them once and rejects what the model code cannot run, so nothing downstream has to guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import UnsupportedModelError

# HF `architectures[0]` -> our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ArchConfig:
    architecture: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None (plain RoPE), {"rope_type": "llama3", factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}, or {"rope_type": "freq_factors", "freq_factors": [...]}
    # (llama.cpp's per-frequency divisors, read from a GGUF `rope_freqs` tensor).
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    # Per layer, the attention's sliding window (None = full attention); () = every layer full.
    # The KV cache groups layers by window (core/kv_cache_groups) and frees what slid out.
    sliding_windows: tuple[int | None, ...] = field(default=(), hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def layer_sliding_window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    @staticmethod
    def from_hf_config(cfg: dict[str, Any]) -> ArchConfig:
        """Build from a parsed HF `config.json`; raises UnsupportedModelError for what we cannot run."""
        family = _family(cfg)
        hidden_size = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        max_positions = int(cfg.get("max_position_embeddings") or 2048)
        hidden_act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported; expected 'silu'")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(
                "mlp_bias=true is not supported; expected MLP projections without bias"
            )
        _reject_sliding_window(family, cfg, max_positions)
        num_layers = int(cfg["num_hidden_layers"])
        rope_theta, rope_scaling = _rope(cfg)

        bias = bool(cfg.get("attention_bias", False))
        if family == "qwen2":  # Qwen2 always has q/k/v bias and never an o_proj bias
            qkv_bias, o_bias = True, False
        elif family == "mistral":
            qkv_bias, o_bias = False, False
        else:  # llama and qwen3 put `attention_bias` on all four projections
            qkv_bias, o_bias = bias, bias

        return ArchConfig(
            architecture=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
            sliding_windows=_sliding_windows(family, cfg, num_layers, max_positions),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
        )


def _family(cfg: dict[str, Any]) -> str:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    architectures = cfg.get("architectures") or []
    if architectures:
        name = architectures[0]
        if name not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(f"unsupported model architecture {name!r}; supported: {supported}")
        return SUPPORTED_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES.values():
        return model_type
    raise UnsupportedModelError(
        f"unsupported model (architectures={architectures}, model_type={model_type!r}); supported: {supported}"
    )


def _reject_sliding_window(family: str, cfg: dict[str, Any], max_positions: int) -> None:
    window = cfg.get("sliding_window")
    if family in ("mistral", "qwen2", "qwen3"):
        return  # _sliding_windows reads theirs
    # transformers' Llama has no sliding window: a config naming one is not a Llama we can match,
    # unless the window covers every position.
    if window is not None and int(window) < max_positions:
        raise UnsupportedModelError(
            f"a {family} model with sliding_window={window} < max_position_embeddings={max_positions} "
            "is not supported; expected no sliding_window (a Mistral-style model declares "
            "MistralForCausalLM)"
        )


def _sliding_windows(
    family: str, cfg: dict[str, Any], num_layers: int, max_positions: int
) -> tuple[int | None, ...]:
    """Per layer, its window as transformers applies it; () when no layer has one. Mistral slides
    every layer by `sliding_window`; Qwen2/Qwen3 only with `use_sliding_window`, then the layers
    `layer_types` marks "sliding_attention" (by default those from `max_window_layers` on). A window
    as long as max_position_embeddings never drops a key, so it is plain attention. (A minimal
    reading for the KV cache groups' tests: the `phi` branch parses windows for every family.)"""
    window = cfg.get("sliding_window")
    if window is None or family not in ("mistral", "qwen2", "qwen3"):
        return ()
    window = int(window)
    if window < 1:
        raise UnsupportedModelError(f"sliding_window={window} must be >= 1")
    if window >= max_positions:
        return ()
    if family == "mistral":
        return (window,) * num_layers
    if not cfg.get("use_sliding_window"):
        return ()  # Qwen configs carry a window they only use with use_sliding_window
    max_window_layers = int(cfg.get("max_window_layers", 28))  # transformers' default
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if i >= max_window_layers else "full_attention" for i in range(num_layers)
    ]
    if len(layer_types) != num_layers:
        raise UnsupportedModelError(
            f"layer_types names {len(layer_types)} layers; expected num_hidden_layers={num_layers}"
        )
    windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    return windows if any(w is not None for w in windows) else ()


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers < 5 writes `rope_theta` + `rope_scaling`; transformers 5 writes `rope_parameters`.
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} is not supported; expected 1.0")
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_ROPE_KEYS if k not in params]
        if missing:
            raise UnsupportedModelError(f"llama3 rope scaling is missing {', '.join(missing)}")
        scaling: dict[str, Any] = {"rope_type": "llama3"}
        for key in _LLAMA3_ROPE_KEYS:
            scaling[key] = float(params[key])
        scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        return theta, scaling
    if rope_type == "freq_factors" and "freq_factors" in params:
        return theta, {
            "rope_type": "freq_factors",
            "freq_factors": [float(f) for f in params["freq_factors"]],
        }
    raise UnsupportedModelError(
        f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
