"""Plain-torch references for the FP8 kernel tests (CPU interpreter and GPU): weight and activation
quantization with the kernels' formulas, dequantization, and the error bounds the tests assert.

Activation quantization here computes what kernels/triton/fp8_quant.py computes, in the same
order (absmax, max with MIN_ABSMAX, IEEE divisions, clamp, round-to-nearest-even cast), so the
kernels' FP8 activations must equal these bit for bit. (Every division is tensor by tensor:
PyTorch's CUDA division by a Python number multiplies by its reciprocal, another rounding.)
"""

from __future__ import annotations

import torch

from tokenmill.kernels.triton.fp8_quant import FP8_DTYPE, FP8_MAX, MIN_ABSMAX

BLOCK = (128, 128)
# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2**-4 of itself.
E4M3_REL = 2.0**-4


def quantize_weight(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], float32 scales [N] or [cdiv(N, 128), cdiv(K, 128)]) for a float weight."""
    w = w.float()
    n, k = w.shape
    if block is None:
        scale = w.abs().amax(dim=1).clamp(min=MIN_ABSMAX) / FP8_MAX
        return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    bn, bk = block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = torch.zeros(nb * bn, kb * bk, device=w.device)
    padded[:n, :k] = w
    tiles = padded.view(nb, bn, kb, bk)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=MIN_ABSMAX) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:n, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 [N, K] weight an FP8 weight stands for."""
    w = weight.float()
    if block is None:
        return w * scale.reshape(-1, 1)
    n, k = w.shape
    full = scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return w * full


def quantize_activations(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq, scale) as fp8_quant.quantize_per_token (group None: scale [M, 1]) or
    quantize_per_token_group (scale [M, cdiv(K, group)]) compute them."""
    x = x.float()
    m, k = x.shape
    g = k if group is None else group
    kb = -(-k // g)
    padded = torch.zeros(m, kb * g, device=x.device)
    padded[:, :k] = x
    groups = padded.view(m, kb, g)
    absmax = groups.abs().amax(dim=2).clamp(min=MIN_ABSMAX)
    scale = absmax / torch.full_like(absmax, FP8_MAX)
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(m, kb * g)[:, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def dequantize_activations(xq: torch.Tensor, scale: torch.Tensor, group: int | None) -> torch.Tensor:
    x = xq.float()
    if group is None:
        return x * scale.reshape(-1, 1)
    return x * scale.repeat_interleave(group, dim=1)[:, : x.shape[1]]


def linear_reference(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ w.T + bias + residual, |x| @ |w|.T) in float32 (float64 accumulation): the exact
    product and the magnitude sum that bounds every rounding error of the dot products."""
    xd, wd = x.double(), w.double()
    y = xd @ wd.t()
    if bias is not None:
        y += bias.double()
    if residual is not None:
        y += residual.double()
    return y.float(), (xd.abs() @ wd.abs().t()).float()


def assert_close_to(
    got: torch.Tensor,
    exact: torch.Tensor,
    magnitude: torch.Tensor,
    dot_rel: float,
    what: str,
    out_ulps: float = 0.5,
) -> None:
    """|got - exact| <= (out_ulps ulps of got's dtype) * |exact| + dot_rel * magnitude, elementwise:
    one rounding to the output dtype (half an ulp to nearest; Triton's interpreter truncates float32
    to 16 bits: a whole ulp) plus an error of at most dot_rel times sum_k |x_k w_k| from the dot
    products (summation, or the activations' FP8 rounding)."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[got.dtype]
    out_rel = out_ulps * 2.0**-mantissa_bits
    err = (got.float() - exact).abs()
    bound = out_rel * exact.abs() + dot_rel * magnitude + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, (
        f"{what}: error exceeds the bound by {worst:.2f}x (max |err| {err.max().item():.3e}, "
        f"max |exact| {exact.abs().max().item():.3e}, dot_rel {dot_rel:.1e})"
    )
