"""The CPU linear method for bfloat16 / float16 weights: products of up to four rows (decode steps)
through the C++ 16-bit GEMV (kernels/cpu/csrc/cpu_gemv16.cpp), larger ones through F.linear.

On the 2-core dev machine one-row bfloat16 F.linear calls read a model's weights from memory at
~12 GB/s where the kernel reads them at ~17 (35-50 against 20-25 for weights in cache; BENCHMARKS.md,
"Issue 15, the CPU path of mixture-of-experts models"); both sum in float32 and round once, so the
products differ by summation order only. A bias is added in float32 before that one rounding, as
F.linear adds it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tokenmill.kernels.cpu import gemv16 as gemv16_kernel
from tokenmill.model.layers.linear import LinearBase
from tokenmill.model.layers.linear_method import LinearMethod, finish_product

logger = logging.getLogger(__name__)


class Cpu16BitGemvMethod(LinearMethod):
    def process_layers_after_loading(self, layers: Sequence[LinearBase]) -> None:
        super().process_layers_after_loading(layers)
        from tokenmill.kernels.cpu.build import cpu_kernels_available

        available, why = cpu_kernels_available()  # builds them once if no other path has
        if not available:
            logger.warning("16-bit CPU matmuls run through F.linear: %s", why)
        elif gemv16_kernel.rows_limit() == 0:
            logger.info("16-bit CPU matmuls run through F.linear: this CPU build has no AVX-512 or AVX2 path")

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        weight = layer.weight
        x2 = x.reshape(-1, x.shape[-1])
        if not gemv16_kernel.serves(x2, weight):
            return super().apply(layer, x, bias, residual, out_dtype)
        if bias is None:
            y = gemv16_kernel.gemv16(x2, weight)
        else:
            y = gemv16_kernel.gemv16(x2, weight, out_dtype=torch.float32).add_(bias.float()).to(x.dtype)
        return finish_product(y.view(*x.shape[:-1], weight.shape[0]), residual, out_dtype)
