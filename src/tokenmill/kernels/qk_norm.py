"""A layer's per-head Q/K RMSNorm as the kernels that apply it take it.

Qwen3 and Gemma 3 normalize each q and k head before RoPE. The Triton RoPE launchers
(triton/elementwise.py) and the attention backends' fused decode launch take this one value
instead of three loose arguments; it lives here, below both (attention/backend.py re-exports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class QKNorm:
    """The [head_dim] weights of a layer's q and k norms and their eps (16-bit weights: normalize,
    round, multiply, round, as layers/rmsnorm.rms_norm; float32: Gemma's 1 + w, multiplied before
    the one rounding)."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
