"""One-row matmuls straight from GGUF-quantized weights, on the CPU.

A request decoding alone multiplies one row of activations by every weight matrix, so the step
costs what reading the weights costs: 540 MB a token for SmolLM2-135M as float32, against 96 MB
as the GGUF's own Q4_1 / Q8_0 blocks. Where a GGUF model's weights come in those types, CausalLM
keeps the blocks beside the float32 weights (attach) and `linear` sends one-row products to the
C++ kernel (attention/csrc/cpu_quant_gemv.cpp), which dequantizes each block of 32 in registers
and multiplies it with the float32 activations: the float32 product of the dequantized weights up
to summation order. Larger batches keep the float32 (oneDNN-packed) path, where the arithmetic,
not the bytes, is the cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BLOCKS_ATTR = "gguf_blocks"
_PLAIN_ATTR = "plain_weight"  # layers/linear.py's float32 copy for one-row steps: no longer needed


@dataclass(frozen=True, slots=True)
class QuantizedBlocks:
    blocks: torch.Tensor  # uint8 [out_features, row_bytes]: GGUF blocks, one row per output
    quant_type: int  # the kernel's code: 0 = Q4_1, 1 = Q8_0
    out_features: int


def attach(weight: torch.Tensor, blocks: QuantizedBlocks) -> None:
    """Route `weight`'s one-row products to `blocks`; drop the plain float32 copy kept for them."""
    setattr(weight, _BLOCKS_ATTR, blocks)
    if hasattr(weight, _PLAIN_ATTR):
        delattr(weight, _PLAIN_ATTR)


def quantized_blocks(weight: torch.Tensor) -> QuantizedBlocks | None:
    return getattr(weight, _BLOCKS_ATTR, None)


def quantized_linear(x: torch.Tensor, blocks: QuantizedBlocks, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 @ dequant(blocks)^T (+ bias) -> float32 [M, out_features]."""
    out = torch.empty((x.shape[0], blocks.out_features), dtype=torch.float32)
    torch.ops.tokenmill_cpu.quant_gemv(out, x.contiguous(), blocks.blocks, blocks.quant_type)
    if bias is not None:
        out += bias
    return out
