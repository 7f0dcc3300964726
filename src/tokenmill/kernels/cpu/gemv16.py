"""The CPU's few-row matmul over bfloat16 / float16 weights (csrc/cpu_gemv16.cpp): when it applies
and its op wrapper. The linear method that uses it is model/layers/cpu_gemv16_linear.py; the CPU's
mixture-of-experts ops use it for the experts (model/layers/moe.py)."""

from __future__ import annotations

import torch

from tokenmill.kernels.cpu.build import kernels_loaded

GEMV16_DTYPES = (torch.bfloat16, torch.float16)
_rows_limit: int | None = None  # known once the kernels are loaded


def rows_limit() -> int:
    """Rows a product may have to use the kernel here: 0 until this process has loaded the CPU
    kernels (never builds them) or where the build has no vector path (AVX-512, or AVX2 + FMA +
    F16C), else the kernel's limit (4)."""
    global _rows_limit
    if _rows_limit is None:
        if not kernels_loaded():
            return 0
        ops = torch.ops.tokenmill_cpu
        _rows_limit = int(ops.gemv16_max_rows()) if ops.gemv16_available() else 0
    return _rows_limit


def serves(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `gemv16` takes x2 [M, K] @ weight [N, K]^T: both the same 16-bit dtype on the CPU, a
    contiguous weight, and few enough rows."""
    return (
        x2.dtype in GEMV16_DTYPES
        and weight.dtype == x2.dtype
        and x2.dim() == 2
        and weight.dim() == 2
        and x2.device.type == "cpu"
        and weight.device.type == "cpu"
        and weight.is_contiguous()
        and x2.shape[1] == weight.shape[1]
        and 1 <= x2.shape[0] <= rows_limit()
    )


def gemv16(x2: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x2 [M, K] @ weight [N, K]^T as [M, N] in `out_dtype` (x2's, or float32: no rounding), summed
    in float32; call where `serves(x2, weight)`."""
    out = torch.empty((x2.shape[0], weight.shape[0]), dtype=out_dtype or x2.dtype)
    torch.ops.tokenmill_cpu.gemv16(out, x2.contiguous(), weight)
    return out


def linear16(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x2, weight) without a bias, through the kernel where it serves."""
    if serves(x2, weight):
        return gemv16(x2, weight)
    return torch.nn.functional.linear(x2, weight)


def serves_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """Whether `moe_experts16` takes these tokens' routed experts: 16-bit x of up to `rows_limit()`
    tokens and contiguous stacked expert weights of its dtype, on the CPU."""
    return (
        x.dtype in GEMV16_DTYPES
        and x.device.type == "cpu"
        and x.dim() == 2
        and 1 <= x.shape[0] <= rows_limit()
        and gate_up_proj.dtype == down_proj.dtype == x.dtype
        and gate_up_proj.is_contiguous()
        and down_proj.is_contiguous()
    )


def moe_experts16(
    x: torch.Tensor,  # [T, H]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32 or x's dtype
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    """The routed experts' output [T, H] in one call (csrc/cpu_gemv16.cpp moe_experts16), rounded as
    TorchMoEOps.experts rounds; call where `serves_experts`."""
    out = torch.empty_like(x)
    weights = topk_weights if topk_weights.dtype in (torch.float32, x.dtype) else topk_weights.float()
    torch.ops.tokenmill_cpu.moe_experts16(
        out, x.contiguous(), gate_up_proj, down_proj, topk_ids.long().contiguous(), weights.contiguous()
    )
    return out
