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
