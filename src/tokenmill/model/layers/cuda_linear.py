"""The CUDA linear method: our row GEMV for one 16-bit row, our skinny GEMM for 2-8, cuBLAS otherwise.

Both our kernels (kernels/triton/gemv.py, kernels/triton/skinny_gemm.py) need the weights out-major, as
checkpoints store them. With KernelConfig.row_gemv off every matmul goes to cuBLAS with the weights
stored in-major instead, the layout its few-row kernels read fastest: the engine as it was before
these kernels, for same-run comparisons. With skinny_gemm off the row GEMV and out-major weights
stay but 2+ rows go to cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.model.layers.linear import LinearBase
from tokenmill.model.layers.linear_method import LinearMethod

_few_row_kernels = None


def _kernels():
    """(gemv, skinny_gemm) modules, imported on first use: triton is optional on CPU-only installs.
    Their functions are looked up on the module at each call (tests count calls by patching them)."""
    global _few_row_kernels
    if _few_row_kernels is None:
        from tokenmill.kernels.triton import gemv, skinny_gemm

        _few_row_kernels = (gemv, skinny_gemm)
    return _few_row_kernels


class CudaLinearMethod(LinearMethod):
    residual_in_epilogue = True  # the row GEMV's epilogue, or cuBLAS's beta = 1
    folds_input_scale = True

    def __init__(self, *, row_gemv: bool = True, skinny_gemm: bool = True) -> None:
        self.row_gemv = row_gemv
        self.skinny_gemm = row_gemv and skinny_gemm

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        if self.row_gemv or layer.weight_is_shared:
            return
        # Keep the weight's logical [out, in] shape but store it transposed (in-major): F.linear then
        # hands cuBLAS a plain row-major [in, out] operand, and at decode batch sizes its kernels for
        # that layout read weights faster: on an H200 (BENCHMARKS.md, gemv_microbench, batch 1)
        # down_proj 30.0 vs 32.6 us, lm_head 234 vs 255 us, the rest within 2 %. A tied lm_head stays
        # as it is: it is also the embedding table, gathered by rows. Only with the row GEMV off: it
        # reads the out-major layout, and beats cuBLAS in either one at the few-row steps where the
        # layout mattered.
        weight = layer.weight
        weight.data = weight.data.t().contiguous().t()

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        weight = layer.weight
        if residual is not None and bias is None:
            return self._matmul_add(residual, x, weight)
        y = self._few_row_matmul(x, weight, bias, out_dtype)
        if y is None:
            y = F.linear(x, weight, bias)
            if out_dtype is not None:
                y = y.to(out_dtype)
        return y if residual is None else residual.add_(y)

    def _few_row_matmul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype
    ) -> torch.Tensor | None:
        """Our kernel's result for a matmul of 1-8 rows that one of them serves, else None."""
        if not self.row_gemv or x.dim() != 2:
            return None
        gemv, skinny = _kernels()
        if x.shape[0] > skinny.MAX_ROWS:  # the common prefill case: out at the cheapest check
            return None
        if gemv.use_row_gemv(x, weight):
            return gemv.row_gemv(x, weight, bias, out_dtype=out_dtype)
        if self.skinny_gemm and skinny.use_skinny_gemm(x, weight):
            return skinny.skinny_gemm(x, weight, bias, out_dtype=out_dtype)
        return None

    def _matmul_add(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`residual + x @ weight.T` with the add inside the matmul's launch. The row GEMV writes a new
        tensor: writing into the residual it reads made o_proj 12.3 instead of 10.0 us and down 32.0
        instead of 27.9 on an H200 (benchmarks/row_gemv_microbench.py). cuBLAS (beta = 1) updates
        `residual` in place and returns it: out of place it would copy the residual first."""
        if self.row_gemv:
            gemv, _ = _kernels()
            if gemv.use_row_gemv(x, weight):
                return gemv.row_gemv(x, weight, residual=residual)
        return residual.addmm_(x, weight.t())
