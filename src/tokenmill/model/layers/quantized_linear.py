"""One-row matmuls straight from GGUF-quantized weights, on the CPU.

A request decoding alone multiplies one row of activations by every weight matrix (a few requests:
a few rows), so the step costs what reading the weights costs: 540 MB a token for SmolLM2-135M as float32, against 96 MB
as the GGUF's own Q4_1 / Q8_0 blocks. Where a GGUF model's weights come in those types, the layer's
method is wrapped in a GGUFBlocksMethod holding the blocks (attach_quantized_blocks), which sends
products of up to `rows_limit()` rows to the
C++ kernel (kernels/cpu/csrc/cpu_quant_gemv.cpp), which dequantizes each block of 32 in registers
and multiplies it with the float32 activations: the float32 product of the dequantized weights up
to summation order. Larger batches keep the float32 (oneDNN-packed) path, where the arithmetic,
not the bytes, is the cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenmill.model.layers.linear_method import LinearMethod, WrappingLinearMethod

if TYPE_CHECKING:
    from tokenmill.model.layers.linear import LinearBase

# Steps of up to `rows_limit()` rows use the blocks. With AVX-512 the kernel dequantizes each block
# once for up to 4 rows, which is most of its work: a 3072 x 576 Q4_1 matmul on one core took 325 /
# 406 / 486 / 591 us for 1-4 rows against ~820 us for the float32 oneDNN path at any of those, and
# 1112 against 952 at 8 rows (BENCHMARKS.md). An AVX2 build serves one row; a scalar one none.
_rows_limit: int | None = None


def rows_limit() -> int:
    """Rows a step may have to use the blocks on this build of the kernels (0: never)."""
    global _rows_limit
    if _rows_limit is None:
        _rows_limit = int(torch.ops.tokenmill_cpu.quant_gemv_rows())
    return _rows_limit


# Bytes of one block of 32 weights and, at its start, of its float16 scales (d; d and m for Q4_1).
_BLOCK_BYTES = {0: 20, 1: 34}  # kernel code -> bytes: Q4_1, Q8_0
_SCALE_BYTES = {0: 4, 1: 2}


@dataclass(frozen=True, slots=True)
class QuantizedBlocks:
    blocks: torch.Tensor  # uint8 [out_features, row_bytes] in the kernel's layout (split_rows)
    quant_type: int  # the kernel's code: 0 = Q4_1, 1 = Q8_0
    out_features: int


def split_rows(rows: np.ndarray, quant_type: int) -> np.ndarray:
    """GGUF block rows [N, blocks * block_bytes] -> the kernel's layout: per row, every block's
    quants, then every block's d (then every block's m, for Q4_1); same size, a new array."""
    n = rows.shape[0]
    block_bytes, scale_bytes = _BLOCK_BYTES[quant_type], _SCALE_BYTES[quant_type]
    blocks = rows.reshape(n, -1, block_bytes)
    scales = blocks[:, :, :scale_bytes].reshape(n, -1, scale_bytes // 2, 2).swapaxes(1, 2)
    return np.concatenate([blocks[:, :, scale_bytes:].reshape(n, -1), scales.reshape(n, -1)], axis=1)


def quantized_linear(x: torch.Tensor, blocks: QuantizedBlocks, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 @ dequant(blocks)^T (+ bias) -> float32 [M, out_features]."""
    out = torch.empty((x.shape[0], blocks.out_features), dtype=torch.float32)
    torch.ops.tokenmill_cpu.quant_gemv(out, x.contiguous(), blocks.blocks, blocks.quant_type)
    if bias is not None:
        out += bias
    return out


class GGUFBlocksMethod(WrappingLinearMethod):
    """Products of up to rows_limit() float32 rows from one layer's GGUF blocks; the rest (and
    everything but apply) go to the float method it wraps."""

    def __init__(self, inner: LinearMethod, blocks: QuantizedBlocks) -> None:
        super().__init__(inner)
        self.blocks = blocks

    def blocks_for_rows(self, rows: int) -> QuantizedBlocks | None:
        """The blocks when a product of `rows` rows should use them."""
        return self.blocks if rows <= rows_limit() else None

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if x.dtype == torch.float32 and x.shape[0] <= rows_limit():
            y = quantized_linear(x, self.blocks, bias)
            if residual is not None:
                return residual.add_(y)
            return y if out_dtype is None else y.to(out_dtype)
        return self.inner.apply(layer, x, bias, residual, out_dtype)


def attach_quantized_blocks(layer: LinearBase, blocks: QuantizedBlocks) -> None:
    """Route `layer`'s few-row products to `blocks` and free the float copy kept for single rows
    (the blocks serve those now). Only call it where rows_limit() >= 1."""
    layer.method = GGUFBlocksMethod(layer.method, blocks)
    layer.method.release_single_row_copy(layer)


def quantized_blocks(layer: LinearBase) -> QuantizedBlocks | None:
    """The GGUF blocks `layer` multiplies few rows with, if any."""
    method = layer.method
    while isinstance(method, WrappingLinearMethod):
        if isinstance(method, GGUFBlocksMethod):
            return method.blocks
        method = method.inner
    return None
