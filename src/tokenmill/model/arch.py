"""A normalized description of a decoder-only model, whatever file format it came from.

Hugging Face `config.json` files differ by family and by transformers version (`rope_scaling`
vs `rope_parameters`, implicit `head_dim`, ...). `ArchConfig.from_hf_config` reads all of
them once and rejects what the model code cannot run, so nothing downstream has to guess.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import UnsupportedModelError
from tokenmill.model.moe_config import MoEConfig, moe_config_from_hf

# HF `architectures[0]` -> our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True, slots=True)
class ArchConfig:
    architecture: str  # llama | mistral | qwen2 | qwen3 | mixtral | qwen2_moe | qwen3_moe
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
    # Routed experts (model/moe_config.py); None for dense models.
    moe: MoEConfig | None = None

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
        rope_theta, rope_scaling = _rope(cfg)

        bias = bool(cfg.get("attention_bias", False))
        if family == "qwen2":  # Qwen2 always has q/k/v bias and never an o_proj bias
            qkv_bias, o_bias = True, False
        elif family == "qwen2_moe":  # q/k/v bias unless qkv_bias says otherwise (transformers 5)
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        elif family in ("mistral", "mixtral"):
            qkv_bias, o_bias = False, False
        else:  # llama, qwen3 and qwen3_moe put `attention_bias` on all four projections
            qkv_bias, o_bias = bias, bias

        return ArchConfig(
            architecture=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(cfg.get("eos_token_id")),
            moe=moe_config_from_hf(family, cfg, int(cfg["num_hidden_layers"])),
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
    if family.startswith("qwen"):
        # Qwen configs carry a sliding_window value that is only used when use_sliding_window is set.
        uses_window = bool(cfg.get("use_sliding_window")) or "sliding_attention" in (
            cfg.get("layer_types") or []
        )
    else:
        uses_window = window is not None
    if uses_window and window is not None and int(window) < max_positions:
        raise UnsupportedModelError(
            f"sliding window attention is not supported yet (sliding_window={window} < "
            f"max_position_embeddings={max_positions}); use a checkpoint without a sliding window"
        )


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
