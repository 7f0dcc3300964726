"""gpt-oss's mixture-of-experts block: a router with a bias, and experts with biases and a clamped
SwiGLU, as transformers' GptOssMLP computes them:

    logits = x @ W_router.T + b_router                         [T, E]
    values, ids = top-k of logits; weights = softmax(values)   (in the logits' dtype)
    h = x @ W_gate_up[e].T + b_gate_up[e]                      gate g, up u
    act = (clamp(u, -limit, limit) + 1) * g' * sigmoid(alpha * g'),  g' = min(g, limit)
    y = sum_k weights[:, k] * (act @ W_down[e].T + b_down[e])  (the down bias is weighted too)

Weights are stacked like layers/moe.py's MoEExperts (gate_up_proj [E, 2I, H], gate rows then up
rows; down_proj [E, H, I]) plus gate_up_proj_bias [E, 2I] and down_proj_bias [E, H]; the model's
loader (model/gpt_oss.py) brings the checkpoint's transposed, interleaved layout to this one.

CPU: the pairs sorted by expert and one pair of matmuls per expert that got tokens. CUDA: the
fused MoE Triton kernels with their expert-bias and clamped-SwiGLU switches on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import all_reduce
from tokenmill.model.layers.linear import ReplicatedLinear, bind_hot_path
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.layers.moe import MoEExperts, experts_by_sorted_pairs
from tokenmill.model.moe_config import MoEConfig


def route_top_k_then_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]): transformers' GptOssTopKRouter order, top-k of the
    logits, then a softmax over those k in the logits' dtype."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] (gate columns, then up columns) -> [N, I]."""
    inter = gate_up.shape[-1] // 2
    gate = gate_up[:, :inter].clamp(max=limit)
    up = gate_up[:, inter:].clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class BiasedMoEExperts(MoEExperts):
    """MoEExperts plus a bias per expert on gate_up_proj [E, 2I] and down_proj [E, H].

    With tensor parallelism the gate / up biases are cut like their rows (this rank's I/n of each);
    the down bias is whole and only rank 0 adds it (`adds_down_bias`), before the block's all-reduce."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, device=None,
        dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:  # fmt: skip
        super().__init__(
            num_experts, hidden_size, intermediate_size, device=device, dtype=dtype, tp_rank=tp_rank,
            tp_size=tp_size,
        )  # fmt: skip
        dtype = dtype or torch.float32
        self.gate_up_proj_bias = nn.Parameter(
            torch.empty((num_experts, 2 * self.intermediate_size), device=device, dtype=dtype), requires_grad=False
        )
        self.down_proj_bias = nn.Parameter(
            torch.empty((num_experts, hidden_size), device=device, dtype=dtype), requires_grad=False
        )
        self.adds_down_bias = tp_rank == 0

    @torch.no_grad()
    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard_id=None) -> None:
        """As MoEExperts.weight_loader; the biases load as whole stacked tensors (shard_id None),
        gate_up_proj_bias [E, 2I] (gate columns, then up) cut to this rank's columns of each."""
        if param_name not in ("gate_up_proj_bias", "down_proj_bias"):
            return super().weight_loader(param_name, loaded, shard_id)
        if shard_id is not None:
            raise ValueError(f"{param_name} loads as one stacked tensor, not shard {shard_id!r}")
        param: torch.Tensor = getattr(self, param_name).data
        if param_name == "gate_up_proj_bias":
            full, local = self.full_intermediate_size, self.intermediate_size
            if tuple(loaded.shape) != (self.num_experts, 2 * full):
                raise ValueError(
                    f"shape {tuple(loaded.shape)} does not match the model's {(self.num_experts, 2 * full)}"
                )
            start = self.tp_rank * local
            gate, up = loaded[:, start : start + local], loaded[:, full + start : full + start + local]
            loaded = torch.cat((gate, up), dim=1)
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's {tuple(param.shape)}")
        param.copy_(loaded)


def biased_experts_torch(
    x: torch.Tensor,  # [T, H]
    experts: BiasedMoEExperts,
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """The CPU's experts: pairs sorted by expert, a loop over the experts that got tokens only."""

    down_bias = experts.down_proj_bias if experts.adds_down_bias else None

    def expert_output(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(rows, experts.gate_up_proj[expert], experts.gate_up_proj_bias[expert])
        act = clamped_swiglu(gate_up, alpha, limit)
        return F.linear(act, experts.down_proj[expert], None if down_bias is None else down_bias[expert])

    return experts_by_sorted_pairs(x, topk_weights, topk_ids, experts.num_experts, expert_output)


class GptOssMoEBlock(nn.Module):
    """Router (`mlp.router`, with bias) + biased clamped-SwiGLU experts (`mlp.experts`)."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        *,
        linear_method: LinearMethod | None = None,
        device=None,
        dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """`tp_rank` of `tp_size`: the share of every expert's intermediate dimension this block
        holds (the router is whole); forward all-reduces the ranks' partial sums."""
        super().__init__()
        if moe.clamped_swiglu is None or not moe.biases:
            raise ValueError("GptOssMoEBlock needs a MoEConfig with biases and clamped_swiglu (gpt-oss's)")
        place = {"device": device, "dtype": dtype}
        self.router = ReplicatedLinear(hidden_size, moe.num_experts, bias=True, method=linear_method, **place)
        self.experts = BiasedMoEExperts(
            moe.num_experts, hidden_size, moe.expert_intermediate_size, tp_rank=tp_rank, tp_size=tp_size, **place
        )
        self.top_k = moe.top_k
        self.alpha, self.limit = moe.clamped_swiglu
        self._fused_moe = None
        if torch.device(device or "cpu").type == "cuda":
            self.use_fused_kernels()
        bind_hot_path(self, router_=self.router, experts_=self.experts)

    def use_fused_kernels(self) -> None:
        """Run the experts in kernels/triton/fused_moe.py (CUDA's path; tests run it on the CPU
        under TRITON_INTERPRET=1)."""
        from tokenmill.kernels.triton import fused_moe  # triton is optional on CPU-only installs

        self._fused_moe = fused_moe.fused_moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output [T, hidden], not yet added to the residual stream."""
        weights, ids = route_top_k_then_softmax(self._router_(x), self.top_k)
        experts = self._experts_
        if self._fused_moe is not None:
            out = self._fused_moe(
                x, experts.gate_up_proj, experts.down_proj, weights.float(), ids.to(torch.int32),
                gate_up_bias=experts.gate_up_proj_bias,
                down_bias=experts.down_proj_bias if experts.adds_down_bias else None,
                clamped_swiglu=(self.alpha, self.limit),
            )  # fmt: skip
        else:
            out = biased_experts_torch(x, experts, weights, ids, self.alpha, self.limit)
        return all_reduce(out)  # this rank's partial sums -> the whole output (one rank: as is)

    __call__ = forward
