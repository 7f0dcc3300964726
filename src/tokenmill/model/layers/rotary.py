"""Rotary position embeddings (the "rotate half" layout HF checkpoints use) and their scalings.

cos/sin are precomputed for every position once, so a forward pass only gathers rows by
position: no trigonometry and no host syncs per step. Every scaling type is therefore a fixed
set of frequencies plus one attention factor folded into the tables, computed the way
transformers' `modeling_rope_utils` computes them:

- llama3, freq_factors (llama.cpp's per-frequency divisors), linear (frequencies / factor);
- dynamic (NTK): transformers recomputes the frequencies only once a sequence outgrows
  max_position_embeddings, which our positions never do (max_model_len is bounded by it), so the
  table is the one transformers starts with;
- yarn: frequencies blended between interpolated and extrapolated by a ramp over the dimensions
  (beta_fast / beta_slow), cos and sin multiplied by the attention factor (mscale);
- longrope (Phi-3 / Phi-4): per-frequency short or long factors and an attention factor. A
  table holds one set for every position, so the choice is made for the engine's context, as
  vLLM makes it: the long factors when max_positions (max_model_len) exceeds
  original_max_position_embeddings, else the short ones. transformers picks per forward call by
  the longest position in it, so the two agree whenever a sequence stays on one side of
  original_max_position_embeddings with a short context, or exceeds it from its prompt on.

Partial rotary (`rotary_dim` < head_dim, Phi-4-mini) rotates the first rotary_dim dimensions of
a head as pairs (i, i + rotary_dim / 2) and leaves the rest alone. Our kernels (the torch ops,
the Triton and C++ launches) all rotate the pairs (i, i + head_dim / 2) over a head_dim-wide
table; so the q and k projection rows are permuted within each head at load
(`partial_rotary_permutation`) to put the rotated pairs there, and the table gives the other
dimensions cos 1 and sin 0. The same permutation of q and k leaves every q·k, and so the
attention, unchanged.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inv_freq(
    head_dim: int, theta: float, rope_scaling: dict[str, Any] | None, device=None, max_positions: int = 0
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, computed the way transformers does.

    `head_dim` is the rotated width (rotary_dim under partial rotary); `max_positions` only
    matters to longrope (which factors)."""
    return rope_frequencies(head_dim, theta, rope_scaling, max_positions, device=device)[0]


def rope_frequencies(
    rotary_dim: int, theta: float, rope_scaling: dict[str, Any] | None, max_positions: int, device=None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, the factor cos and sin are multiplied by)."""
    if rope_scaling is None:
        return _plain_inv_freq(rotary_dim, theta, device), 1.0
    rope_type = rope_scaling["rope_type"]
    if rope_type == "llama3":
        return _llama3_scaled(_plain_inv_freq(rotary_dim, theta, device), rope_scaling), 1.0
    if rope_type == "freq_factors":
        inv_freq = _plain_inv_freq(rotary_dim, theta, device)
        factors = torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32, device=device)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope freq_factors has {factors.numel()} entries; expected {inv_freq.numel()}")
        return inv_freq / factors, 1.0
    if rope_type == "linear":
        return _plain_inv_freq(rotary_dim, theta, device) / rope_scaling["factor"], 1.0
    if rope_type == "dynamic":
        return _dynamic_ntk_inv_freq(rotary_dim, theta, rope_scaling, max_positions, device), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, theta, rope_scaling, device), yarn_attention_factor(rope_scaling)
    if rope_type == "longrope":
        return _longrope_inv_freq(rotary_dim, theta, rope_scaling, max_positions, device), (
            longrope_attention_factor(rope_scaling)
        )
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _plain_inv_freq(dim: int, theta: float, device) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


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


def _dynamic_ntk_inv_freq(
    dim: int, theta: float, scaling: dict[str, Any], max_positions: int, device
) -> torch.Tensor:
    # transformers' table at init, for seq_len = max_position_embeddings (its base works out to
    # theta up to float rounding, kept here as it does it). It recomputes only past that length.
    limit = scaling["max_position_embeddings"]
    if max_positions > limit:
        raise ValueError(
            f"dynamic NTK RoPE changes its frequencies past max_position_embeddings ({limit}), which a "
            f"precomputed table cannot follow; use max_model_len <= {limit} (asked for {max_positions})"
        )
    factor = scaling["factor"]
    base = theta * ((factor * limit / limit) - (factor - 1)) ** (dim / (dim - 2))
    return _plain_inv_freq(dim, base, device)


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any], device) -> torch.Tensor:
    factor = scaling["factor"]
    original_context = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times into the original context.
        return (dim * math.log(original_context / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp

    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    # High frequencies (below `low`) keep their extrapolated value, low ones (past `high`) are
    # interpolated by `factor`, the dimensions between blend linearly.
    keep = (1 - ramp).to(device)
    return interpolated * (1 - keep) + extrapolated * keep


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """YaRN's mscale: given, or 0.1 ln(factor) + 1 (a ratio of two with mscale / mscale_all_dim)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def _longrope_inv_freq(
    dim: int, theta: float, scaling: dict[str, Any], max_positions: int, device
) -> torch.Tensor:
    long_context = max_positions > scaling["original_max_position_embeddings"]
    factors = scaling["long_factor" if long_context else "short_factor"]
    if len(factors) != dim // 2:
        raise ValueError(f"longrope factors have {len(factors)} entries; expected rotary_dim / 2 = {dim // 2}")
    ext_factors = torch.tensor(factors, dtype=torch.float32, device=device)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext_factors * theta**exponents)


def longrope_attention_factor(scaling: dict[str, Any]) -> float:
    """Given, or sqrt(1 + ln(factor) / ln(original context)) (1 when factor <= 1)."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaling["factor"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def partial_rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """perm [head_dim]: our dimension j holds the checkpoint's dimension perm[j] of a q or k head,
    so that its rotated pairs (i, i + rotary_dim / 2) land on (i, i + head_dim / 2), the pairs our
    kernels rotate, and the unrotated dimensions fill the rest of each half in order."""
    if rotary_dim % 2 or head_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and within an even head_dim {head_dim}")
    half_rot, half_pass = rotary_dim // 2, (head_dim - rotary_dim) // 2
    first = list(range(half_rot)) + list(range(rotary_dim, rotary_dim + half_pass))
    second = list(range(half_rot, rotary_dim)) + list(range(rotary_dim + half_pass, head_dim))
    return torch.tensor(first + second, dtype=torch.int64)


class RotaryEmbedding(nn.Module):
    """Holds cos and a sign-folded sin for every position up to `max_positions`, head_dim wide."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        rope_scaling: dict[str, Any] | None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        rotary_dim: int | None = None,
    ) -> None:
        """`rotary_dim` < head_dim: partial rotary, in the permuted layout partial_rotary_permutation
        gives q and k (see the module's docstring)."""
        super().__init__()
        rotary_dim = rotary_dim or head_dim
        if rotary_dim != head_dim:
            partial_rotary_permutation(head_dim, rotary_dim)  # validates the widths
        inv_freq, attention_factor = rope_frequencies(rotary_dim, theta, rope_scaling, max_positions, device)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        cos = freqs.cos() * attention_factor
        sin = freqs.sin() * attention_factor
        if rotary_dim < head_dim:  # unrotated dimensions: cos 1, sin 0 (no attention factor either)
            unrotated = (max_positions, (head_dim - rotary_dim) // 2)
            cos = torch.cat((cos, torch.ones(unrotated, device=device)), dim=-1)
            sin = torch.cat((sin, torch.zeros(unrotated, device=device)), dim=-1)
        # rotate_half(x) * sin == roll(x, half) * [-sin, sin]: folding the sign into the table
        # turns RoPE into roll + two multiplies + add.
        self.register_buffer("cos_cache", torch.cat((cos, cos), dim=-1).to(dtype), persistent=False)
        self.register_buffer("sin_cache", torch.cat((-sin, sin), dim=-1).to(dtype), persistent=False)
        self.half = head_dim // 2

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for `positions` [T], shaped [T, 1, head_dim] to broadcast over heads."""
        cos = self.cos_cache.index_select(0, positions).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] (may be a strided view) -> rotated copy."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.roll(x, half, dims=-1), signed_sin)
