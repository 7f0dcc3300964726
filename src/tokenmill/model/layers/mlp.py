"""The SwiGLU MLP with gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model.layers.linear import linear


def swiglu_mlp(x: torch.Tensor, gate_up_weight: torch.Tensor, down_weight: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); `gate_up_weight` is [2 * intermediate, hidden], gate rows first."""
    gate_up = linear(x, gate_up_weight)
    intermediate = gate_up_weight.shape[0] // 2
    gate = gate_up[..., :intermediate]
    up = gate_up[..., intermediate:]
    # silu in place on the gate half of a buffer we own, then one multiply into a fresh contiguous tensor
    return linear(F.silu(gate, inplace=True) * up, down_weight)
