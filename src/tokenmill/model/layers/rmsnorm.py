"""RMSNorm as Llama/Qwen define it (normalize in float32, then scale by the weight), and Gemma's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension.

    In float32 this is one fused op. For half types transformers normalizes in float32, rounds
    to the model dtype and only then multiplies by the weight; we keep that order so bf16 runs
    round exactly like the reference.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    normed = F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
    return normed * weight


class RMSNorm(nn.Module):
    """Holds an RMSNorm weight (named like the checkpoints' `*norm.weight`); the decoder's ops
    (layers/layer_ops.py) apply it, fused with the residual add where they can."""

    def __init__(self, size: int, eps: float, device=None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm_float32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a float32 `weight` applied before the one rounding to x's dtype (Gemma's order:
    transformers computes (x / rms(x)) * (1 + w) in float32, then rounds)."""
    return F.rms_norm(x.float(), weight.shape, weight, eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm, x / rms(x) * (1 + w) in float32. `weight` holds 1 + w in float32, whatever
    the model's dtype (the Gemma model converts the checkpoint's w as it loads it), so neither the
    offset nor the upcast costs a launch per call; 1 + w.float() is what transformers computes."""

    def __init__(self, size: int, eps: float, device=None, dtype: torch.dtype | None = None) -> None:
        # (`dtype`: RMSNorm's signature, so that either can be SelfAttention's qk_norm_class.)
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_float32_weight(x, self.weight, self.eps)
