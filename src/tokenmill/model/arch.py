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
    "Phi3ForCausalLM": "phi3",  # Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text model; the vision tower is not loaded
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GptOssForCausalLM": "gpt_oss",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# Families that may rotate only part of each head (layers/rotary.py permutes their q/k rows at load).
_PARTIAL_ROTARY_FAMILIES = ("phi3",)


@dataclass(frozen=True, slots=True)
class ArchConfig:
    architecture: str  # a family: llama, mistral, qwen2, qwen3, phi3, gemma2, gemma3, mixtral, qwen*_moe
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
    # Also {"rope_type": "linear" | "dynamic" | "yarn" | "longrope", ...} with transformers'
    # defaults filled in (layers/rotary.py computes their tables).
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # Dimensions of each q/k head that RoPE rotates when fewer than head_dim (partial rotary,
    # Phi-4-mini); None = the whole head.
    rotary_dim: int | None = None
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool = False
    # The positions the model is run at: config's max_position_embeddings, or the context a YaRN
    # scaling reaches (original_max_position_embeddings x factor) when that is longer.
    max_position_embeddings: int = 2048
    # Per layer, the attention's sliding window (None = full attention); () = every layer full.
    # The KV cache groups layers by window (core/kv_cache_groups) and frees what slid out.
    sliding_windows: tuple[int | None, ...] = field(default=(), hash=False)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Gemma 2 / 3 (parsed by model/arch_gemma.py); the defaults are every other family's.
    hidden_act: str = "silu"  # the MLP gate's activation: silu | gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (None: head_dim's)
    attn_logit_softcap: float | None = None  # every layer's AttentionLayerSpec.logits_soft_cap
    final_logit_softcap: float | None = None  # logits become cap * tanh(logits / cap)
    # RoPE of the sliding-window layers when it differs from the other layers' (Gemma 3's
    # rope_local_base_freq); None = one table for every layer.
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    @property
    def attention_scale(self) -> float:
        """The softmax scale of q.k: 1/sqrt(head_dim), or Gemma's query_pre_attn_scalar ** -0.5."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5
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
        if family in ("gemma2", "gemma3"):
            # Gemma's configs differ in too many keys to share the checks below (arch_gemma imports
            # this module, hence the late import).
            from tokenmill.model.arch_gemma import gemma_arch_config

            return gemma_arch_config(cfg, family)
        if family == "gpt_oss":
            from tokenmill.model.arch_gpt_oss import gpt_oss_arch_config

            return gpt_oss_arch_config(cfg)
        hidden_size = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        hidden_act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported; expected 'silu'")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError(
                "mlp_bias=true is not supported; expected MLP projections without bias"
            )
        rope_theta, rope_scaling, partial_rotary, max_positions = _rope(cfg, family)
        num_layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden_size // num_heads)
        rotary_dim = int(head_dim * partial_rotary)
        if rotary_dim != head_dim and (rotary_dim % 2 or head_dim % 2 or rotary_dim <= 0):
            raise UnsupportedModelError(
                f"partial_rotary_factor={partial_rotary} gives {rotary_dim} rotated dimensions of "
                f"head_dim={head_dim}; expected an even number within an even head_dim"
            )
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(rope_scaling[key]) != rotary_dim // 2:
                    raise UnsupportedModelError(
                        f"longrope {key} has {len(rope_scaling[key])} entries; expected one per rotated "
                        f"pair, {rotary_dim // 2}"
                    )

        bias = bool(cfg.get("attention_bias", False))
        if family == "qwen2":  # Qwen2 always has q/k/v bias and never an o_proj bias
            qkv_bias, o_bias = True, False
        elif family == "qwen2_moe":  # q/k/v bias unless qkv_bias says otherwise (transformers 5)
            qkv_bias, o_bias = bool(cfg.get("qkv_bias", True)), False
        elif family in ("mistral", "phi3", "mixtral"):
            qkv_bias, o_bias = False, False
        else:  # llama, qwen3 and qwen3_moe put `attention_bias` on all four projections
            qkv_bias, o_bias = bias, bias

        return ArchConfig(
            architecture=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rotary_dim=rotary_dim if rotary_dim != head_dim else None,
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
            sliding_windows=_sliding_windows(family, cfg, num_layers, max_positions),
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


def _sliding_windows(
    family: str, cfg: dict[str, Any], num_layers: int, max_positions: int
) -> tuple[int | None, ...]:
    """Per layer, its sliding window as transformers applies it; () when no layer has one.

    Mistral, Mixtral and Phi-3 slide every layer by `sliding_window`. Qwen2/Qwen3 slide only with
    `use_sliding_window`, and then the layers `layer_types` marks "sliding_attention" (by default
    those from `max_window_layers` on). A window as long as max_position_embeddings never drops a
    key (max_model_len is bounded by it), so it is plain attention and asks nothing of the backend.
    """
    window = cfg.get("sliding_window")
    if window is None:
        return ()
    window = int(window)
    if family.startswith("qwen"):  # qwen2, qwen3 and their MoE variants
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
    elif family in ("mistral", "phi3", "mixtral"):
        windows = (window,) * num_layers
    else:
        # transformers' Llama has no sliding window: a config naming one is not a Llama we can
        # match, unless the window covers every position.
        if window < max_positions:
            raise UnsupportedModelError(
                f"a {family} model with sliding_window={window} < max_position_embeddings={max_positions} "
                "is not supported; expected no sliding_window (a Mistral-style model declares "
                "MistralForCausalLM)"
            )
        return ()
    if window < 1:
        raise UnsupportedModelError(f"sliding_window={window} must be >= 1")
    windows = tuple(w if w is not None and w < max_positions else None for w in windows)
    return windows if any(w is not None for w in windows) else ()


def _rope(cfg: dict[str, Any], family: str) -> tuple[float, dict[str, Any] | None, float, int]:
    """(rope_theta, our rope_scaling dict, partial_rotary_factor, max positions the scaling allows)."""
    # transformers < 5 writes `rope_theta` + `rope_scaling`; transformers 5 writes `rope_parameters`.
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    max_positions = int(cfg.get("max_position_embeddings") or 2048)
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0 and family not in _PARTIAL_ROTARY_FAMILIES:
        raise UnsupportedModelError(
            f"partial_rotary_factor={partial} is not supported for {family} models; expected 1.0"
        )
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if family == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # transformers' Phi3Config reads both legacy names as longrope
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers: a top-level original_max_position_embeddings (Phi-3 writes one) wins over
        # the one in the rope parameters, which defaults to max_position_embeddings.
        original = cfg.get("original_max_position_embeddings")
        if original is None:
            original = params.get("original_max_position_embeddings", max_positions)
        params["original_max_position_embeddings"] = int(original)
    if rope_type == "default":
        return theta, None, partial, max_positions
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_ROPE_KEYS if k not in params]
        if missing:
            raise UnsupportedModelError(f"llama3 rope scaling is missing {', '.join(missing)}")
        scaling: dict[str, Any] = {"rope_type": "llama3"}
        for key in _LLAMA3_ROPE_KEYS:
            scaling[key] = float(params[key])
        scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
        return theta, scaling, partial, max_positions
    if rope_type in ("linear", "dynamic"):
        factor = _rope_float(params, "factor", rope_type)
        scaling = {"rope_type": rope_type, "factor": factor}
        if rope_type == "dynamic":
            scaling["max_position_embeddings"] = max_positions
        return theta, scaling, partial, max_positions
    if rope_type == "yarn":
        scaling, reach = _yarn(params, max_positions)
        return theta, scaling, partial, reach
    if rope_type == "longrope":
        return theta, _longrope(params, max_positions), partial, max_positions
    if rope_type == "freq_factors" and "freq_factors" in params:
        scaling = {"rope_type": "freq_factors", "freq_factors": [float(f) for f in params["freq_factors"]]}
        return theta, scaling, partial, max_positions
    raise UnsupportedModelError(
        f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _yarn(params: dict[str, Any], max_positions: int) -> tuple[dict[str, Any], int]:
    """YaRN's parameters with transformers' defaults filled in, and the context it reaches:
    original_max_position_embeddings x factor (Qwen2.5 keeps max_position_embeddings at the
    original 32768 and adds the scaling to reach 131072), as vLLM takes it."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    scaling = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": bool(params.get("truncate", True)),
    }
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            scaling[key] = float(params[key])
    return scaling, max(max_positions, int(original * factor))


def _longrope(params: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """LongRoPE's factors; `factor` defaults to max_position_embeddings / original (Phi-3)."""
    missing = [k for k in ("short_factor", "long_factor") if not params.get(k)]
    if missing:
        raise UnsupportedModelError(f"longrope rope scaling is missing {', '.join(missing)}")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    scaling = {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in params["short_factor"]],
        "long_factor": [float(f) for f in params["long_factor"]],
        "original_max_position_embeddings": original,
        "factor": max_positions / original if factor is None else float(factor),
    }
    if params.get("attention_factor") is not None:
        scaling["attention_factor"] = float(params["attention_factor"])
    return scaling


def _rope_float(params: dict[str, Any], key: str, rope_type: str) -> float:
    if params.get(key) is None:
        raise UnsupportedModelError(f"{rope_type} rope scaling is missing {key}")
    return float(params[key])


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
