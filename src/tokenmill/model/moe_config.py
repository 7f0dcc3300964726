"""The mixture-of-experts part of an architecture: how many experts, how tokens are routed to them,
which layers have them, and whether a shared expert runs beside them.

Read once from a Hugging Face `config.json` (Mixtral, Qwen2-MoE, Qwen3-MoE spell the same things
differently) into one frozen dataclass that `ArchConfig.moe` holds; None for dense models.
Torch-free: the API server resolves models with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.errors import UnsupportedModelError

# ArchConfig families with routed experts.
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int
    top_k: int  # experts per token
    expert_intermediate_size: int  # of each routed expert
    # Renormalize the top-k softmax probabilities to sum to 1 (Mixtral always; Qwen: norm_topk_prob).
    renormalize: bool
    # Layers with a sparse MoE block; the others have the dense MLP of ArchConfig.intermediate_size.
    sparse_layers: tuple[int, ...]
    # Qwen2-MoE: a dense SwiGLU expert every token goes through, scaled by sigmoid(shared_expert_gate(x)).
    shared_expert_intermediate_size: int = 0
    # Whether the routing weights are rounded to the model's dtype before they scale the experts'
    # outputs (Qwen rounds them, Mixtral keeps them in float32): transformers' rounding, kept so
    # that bf16 outputs agree with it as closely as they can.
    weights_in_model_dtype: bool = True
    # gpt-oss (model/arch_gpt_oss.py): a bias on the router and on each expert's gate_up / down
    # projections, top-k taken on the router logits then softmaxed, and its clamped SwiGLU
    # (alpha, limit): (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
    biases: bool = False
    clamped_swiglu: tuple[float, float] | None = None

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers


def moe_config_from_hf(family: str, cfg: dict[str, Any], num_layers: int) -> MoEConfig | None:
    """The MoE part of a parsed HF config for `family`; None for dense families."""
    if family not in MOE_FAMILIES:
        return None
    if family == "mixtral":
        num_experts = int(cfg.get("num_local_experts") or 8)
        top_k = int(cfg.get("num_experts_per_tok") or 2)
        expert_size = int(cfg["intermediate_size"])
        renormalize, shared, in_model_dtype = True, 0, False
        sparse = tuple(range(num_layers))
    else:
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok") or 0)
        expert_size = int(cfg.get("moe_intermediate_size") or 0)
        renormalize = bool(cfg.get("norm_topk_prob", family == "qwen3_moe"))
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0
        in_model_dtype = True
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense_only = {int(i) for i in cfg.get("mlp_only_layers") or ()}
        # transformers' rule (Qwen2MoeDecoderLayer): sparse where not listed as dense and the
        # layer's 1-based index is a multiple of decoder_sparse_step.
        sparse = tuple(
            i for i in range(num_layers) if i not in dense_only and num_experts > 0 and (i + 1) % step == 0
        )
    if num_experts < 1 or top_k < 1 or expert_size < 1:
        raise UnsupportedModelError(
            f"{family} config needs num_experts, num_experts_per_tok and the experts' intermediate size "
            f">= 1; got {num_experts}, {top_k}, {expert_size}"
        )
    if top_k > num_experts:
        raise UnsupportedModelError(
            f"num_experts_per_tok ({top_k}) is more than the number of experts ({num_experts})"
        )
    router_act = cfg.get("scoring_func", "softmax")
    if router_act != "softmax":
        raise UnsupportedModelError(f"router scoring_func {router_act!r} is not supported; expected 'softmax'")
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=expert_size,
        renormalize=renormalize,
        sparse_layers=sparse,
        shared_expert_intermediate_size=shared,
        weights_in_model_dtype=in_model_dtype,
    )
