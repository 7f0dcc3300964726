"""Rotary position embeddings (the "rotate half" layout HF checkpoints use), with Llama-3 scaling.

cos/sin are precomputed for every position once, so a forward pass only gathers rows by
position: no trigonometry and no host syncs per step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None, device=None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, computed the way transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope_scaling)
    if rope_type == "freq_factors":
        factors = torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32, device=device)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors has {factors.numel()} entries; expected {inv_freq.numel()}")
        return inv_freq / factors
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones kept, the band between
    # the two thresholds interpolated smoothly.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Holds cos and a sign-folded sin for every position up to `max_positions`."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        rope_scaling: dict[str, Any] | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, rope_scaling, device=device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        half = head_dim // 2
        cos = freqs.cos()
        sin = freqs.sin()
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: folding the sign into the table
        # turns RoPE into roll + two multiplies + add.
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1).to(dtype), persistent=False)
        self.register_buffer("sin_cache", torch.cat((-sin, sin), dim=-1).to(dtype), persistent=False)
        self.half = half

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for `positions` [T], shaped [T, 1, head_dim] to broadcast over heads."""
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (may be a strided view) -> rotated copy."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.roll(x, half, dims=-1), signed_sin)
