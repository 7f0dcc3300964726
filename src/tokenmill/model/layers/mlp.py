"""The gated MLPs: gate and up projections in one matmul, then down(act(gate) * up); SwiGLU
(Llama, Qwen, Mistral) and GeGLU (Gemma)."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.layers.layer_ops import LayerOps
from tokenmill.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear, bind_hot_path
from tokenmill.model.layers.linear_method import LinearMethod


class SwiGLUMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        ops: LayerOps,
        *,
        linear_method: LinearMethod | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        device=None,
        dtype: torch.dtype | None = None,
        reduce_results: bool = True,
    ) -> None:
        """`reduce_results=False`: with several ranks, forward returns this rank's partial output
        (down_proj's RowParallelLinear does not all-reduce; the caller does, once)."""
        super().__init__()
        shard = {
            "method": linear_method,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "device": device,
            "dtype": dtype,
        }
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, (intermediate_size, intermediate_size), **shard
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, reduce_results=reduce_results, **shard)
        self.ops = ops
        bind_hot_path(self, gate_up=self.gate_up_proj, down=self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)), not yet added to the residual stream."""
        return self._down(self.ops.silu_mul(self._gate_up(x)))

    # Called once per layer per step: skip nn.Module.__call__'s hook dispatch (see LinearBase.__call__).
    __call__ = forward

    # -- the deferred norm (model/llama.DecoderLayer._forward_deferred_norm) ----------------------

    def can_fold_input_scale(self) -> bool:
        """Whether fold_input_scale can fold the preceding norm's weight into this MLP."""
        return self.gate_up_proj.method.folds_input_scale

    def fold_input_scale(self, scale: torch.Tensor) -> None:
        self.gate_up_proj.fold_input_scale(scale)

    def forward_from_residual(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """x + forward(RMSNorm(x)) after fold_input_scale: gate_up projects the un-normalized rows,
        silu_mul applies 1/rms, down adds into the residual in its epilogue."""
        return self.down_proj(self.ops.silu_mul(self._gate_up(x), norm_source=x, eps=eps), residual=x)


class GeGLUMLP(SwiGLUMLP):
    """Gemma's MLP: down(gelu(gate(x)) * up(x)), gelu with the tanh approximation. No deferred
    norm (Gemma's norms scale by 1 + w in float32; model/gemma.py folds nothing)."""

    def can_fold_input_scale(self) -> bool:
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._down(self.ops.gelu_tanh_mul(self._gate_up(x)))

    __call__ = forward
