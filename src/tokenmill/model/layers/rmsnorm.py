"""RMSNorm as Llama/Qwen define it: normalize in float32, then scale by the weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
