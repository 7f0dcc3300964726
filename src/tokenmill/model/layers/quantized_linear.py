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

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tokenmill.kernels.cpu.quant_gemv import ALL_ROWS, QuantizedBlocks, blocks_rows_limit, quantized_linear
from tokenmill.model.layers.linear_method import LinearMethod, WrappingLinearMethod, finish_product

if TYPE_CHECKING:
    from tokenmill.model.layers.linear import LinearBase


class GGUFBlocksMethod(WrappingLinearMethod):
    """Products of up to `max_rows` float32 rows from one layer's GGUF blocks (the one-row kernel
    up to rows_limit(), the batched one above); the rest (prefill chunks, and everything but apply)
    go to the float method it wraps."""

    def __init__(self, inner: LinearMethod, blocks: QuantizedBlocks, gemm_rows: int = 0) -> None:
        super().__init__(inner)
        self.blocks = blocks
        self.max_rows = blocks_rows_limit(gemm_rows)
        # Set when the blocks serve every row count and the inner method's float weights are freed.
        self.float_weights_released = False

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if not self.float_weights_released:  # else there is no float form to make
            self.inner.process_weights_after_loading(layer)

    def process_layers_after_loading(self, layers: Sequence[LinearBase]) -> None:
        if not self.float_weights_released:
            self.inner.process_layers_after_loading(layers)

    def blocks_for_rows(self, rows: int) -> QuantizedBlocks | None:
        """The blocks when a product of `rows` rows should use them."""
        return self.blocks if rows <= self.max_rows else None

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if x.dtype == torch.float32 and x.shape[0] <= self.max_rows:
            return finish_product(quantized_linear(x, self.blocks, bias), residual, out_dtype)
        if self.float_weights_released:
            raise RuntimeError(
                f"this layer keeps only its GGUF blocks, which multiply float32 rows; got {x.dtype} "
                f"[{x.shape[0]} rows]"
            )
        return self.inner.apply(layer, x, bias, residual, out_dtype)


def attach_quantized_blocks(
    layer: LinearBase, blocks: QuantizedBlocks, gemm_rows: int = 0, *, before_loading: bool = False
) -> None:
    """Route `layer`'s few-row products (up to `gemm_rows` rows where the batched kernel exists) to
    `blocks` and free the float copy kept for single rows (the blocks serve those now). Only call it
    where rows_limit() >= 1. `before_loading` (the blocks serving every row count): nothing is loaded
    yet, and the layer's own float weight never will be: it is dropped unfilled (its memory never
    touched) and the checkpoint need not hold it; a shared one (a tied lm_head's embedding table)
    stays for the embedding and is neither loaded for nor processed by this layer."""
    method = layer.method = GGUFBlocksMethod(layer.method, blocks, gemm_rows)
    if before_loading:
        if method.max_rows < ALL_ROWS:
            raise ValueError(f"blocks attached before loading must serve every row count, not {method.max_rows}")
        if not layer.weight_is_shared:
            layer.forget_checkpoint_params()
        method.float_weights_released = True
        return
    if method.max_rows >= ALL_ROWS:
        # Every product goes to the blocks (the AVX2 build's prefill too): the float copies the
        # inner method kept (oneDNN's packed weights, ~430 MiB for the default model) would only
        # take memory.
        method.release_float_copies(layer)
        method.float_weights_released = True
    else:
        method.release_single_row_copy(layer)


def quantized_blocks(layer: LinearBase) -> QuantizedBlocks | None:
    """The GGUF blocks `layer` multiplies few rows with, if any."""
    method = layer.method
    while isinstance(method, WrappingLinearMethod):
        if isinstance(method, GGUFBlocksMethod):
            return method.blocks
        method = method.inner
    return None


def gguf_block_bytes(model: torch.nn.Module) -> int:
    """Bytes of GGUF blocks a one-row decode step reads (the integer-activation layout where a
    layer has it), minus the float weights those layers still hold: decode reads the blocks."""
    from tokenmill.model.layers.linear import linear_layers

    total = 0
    for layer in linear_layers(model):
        blocks = quantized_blocks(layer)
        if blocks is None:
            continue
        read = blocks.vnni if blocks.vnni is not None and blocks.activation_bits else blocks.blocks
        total += 0 if read is None else read.numel() * read.element_size()
        weight = layer._parameters.get("weight")
        if weight is not None and not layer.weight_is_shared:  # loaded (the blocks serve few rows only)
            total -= weight.numel() * weight.element_size()
    return total
