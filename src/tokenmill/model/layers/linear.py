"""Matmuls against weights prepacked for oneDNN on the CPU.

On the CPU, F.linear over a plain [out, in] float32 weight goes to MKL's sgemm, which is slow in
the middle of the decode batch range (a 3072x576 matmul at 16 rows took 1.96 ms against 0.46 ms
for the same weight prepacked; lm_head at 64 rows 55 ms against 41: best-of-7 timings of single
matmuls on the 2-core dev machine; the end-to-end A/B is in BENCHMARKS.md). oneDNN's linear takes a weight reordered once into its blocked
layout, the same size as the original, and works for any number of rows.

But each oneDNN call costs ~40 us more than MKL's on one thread, which a single-row matmul (one
request decoding) feels: a token's matmuls took 38.3 ms packed against 32.0 ms plain on one
thread. So a packed weight may keep its plain original beside it for single-row calls; the
caller decides whether that memory is worth it (CausalLM keeps them up to a budget).

A packed weight replaces the module's parameter (an opaque oneDNN tensor cannot be a
Parameter's data) and is marked, so `linear` knows to route it; only `linear` may read it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from tokenmill.model.layers.quantized_linear import blocks_for_rows, quantized_linear

_PACKED_ATTR = "onednn_packed"
_PLAIN_ATTR = "plain_weight"  # the original [out, in] weight, when kept for single-row calls
# The row count oneDNN tunes the blocked layout for; the packed weight serves any row count.
_PACK_BATCH_HINT = 64

# On CUDA, matmuls of one 16-bit row go to our row GEMV (kernels/triton/gemv.py) and of 2-8 rows to our
# skinny GEMM (kernels/triton/skinny_gemm.py); both need the weights out-major, as checkpoints store them.
# TOKENMILL_ROW_GEMV=0 sends every matmul to cuBLAS with the weights stored in-major instead
# (CausalLM.store_matmul_weights_k_major), the layout its few-row kernels read fastest: the engine
# as it was before these kernels, for same-run comparisons. TOKENMILL_SKINNY_GEMM=0 keeps the row
# GEMV and out-major weights but sends 2+ rows to cuBLAS.
ROW_GEMV = os.environ.get("TOKENMILL_ROW_GEMV", "1") != "0"
SKINNY_GEMM = ROW_GEMV and os.environ.get("TOKENMILL_SKINNY_GEMM", "1") != "0"
_few_row_kernels = None


def _kernels():
    """(gemv, skinny_gemm), imported on first use: triton is optional on CPU-only installs."""
    global _few_row_kernels
    if _few_row_kernels is None:
        from tokenmill.kernels.triton import gemv, skinny_gemm

        _few_row_kernels = (gemv, skinny_gemm)
    return _few_row_kernels


def _few_row_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype):
    """Our kernel's result for a CUDA matmul of 1-8 rows that one of them serves, else None."""
    if not ROW_GEMV or x.dim() != 2:
        return None
    gemv, skinny = _kernels()
    if x.shape[0] > skinny.MAX_ROWS:  # the common prefill case: out at the cheapest check
        return None
    if gemv.use_row_gemv(x, weight):
        return gemv.row_gemv(x, weight, bias, out_dtype=out_dtype)
    if SKINNY_GEMM and skinny.use_skinny_gemm(x, weight):
        return skinny.skinny_gemm(x, weight, bias, out_dtype=out_dtype)
    return None


def onednn_packing_available(dtype: torch.dtype) -> bool:
    """float32 on a CPU build with oneDNN (bf16 packing only pays with AMX/AVX512-BF16; not tried)."""
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor, *, keep_plain: bool = False) -> torch.Tensor:
    """The oneDNN-packed copy of an [out, in] CPU weight, marked for `linear` (with the original
    kept for single-row calls when `keep_plain`)."""
    plain = weight.detach().contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(plain, _PACK_BATCH_HINT)
    setattr(packed, _PACKED_ATTR, True)
    if keep_plain:
        setattr(packed, _PLAIN_ATTR, plain)
    return packed


def pack_parameter(module: torch.nn.Module, name: str, *, keep_plain: bool = False) -> None:
    """Replace the weight parameter `name` of `module` by its packed form (same number of bytes,
    twice that with `keep_plain`)."""
    packed = pack_weight(getattr(module, name), keep_plain=keep_plain)
    del module._parameters[name]  # without keep_plain the original is freed
    setattr(module, name, packed)


def drop_plain_copy(weight: torch.Tensor) -> None:
    """Free the plain copy kept beside a packed weight for single-row calls (when something else,
    such as GGUF blocks, serves those now)."""
    if hasattr(weight, _PLAIN_ATTR):
        delattr(weight, _PLAIN_ATTR)


def is_packed(weight: torch.Tensor) -> bool:
    return getattr(weight, _PACKED_ATTR, False)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """F.linear, or on CUDA our row GEMV / skinny GEMM for 1 / 2-8 rows; on the CPU oneDNN's
    linear for a weight packed by this module (its plain original, where kept, for a single
    row), and a few float32 rows go to the weight's GGUF blocks where it has them
    (layers/quantized_linear.py). `out_dtype` converts the result (our kernels write it
    directly, without a cast launch)."""
    if x.is_cuda:
        y = _few_row_matmul(x, weight, bias, out_dtype)
        if y is not None:
            return y
        y = F.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)
    y = _cpu_linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def linear_add(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`residual + x @ weight.T` with the add inside the matmul's launch. The row GEMV writes a new
    tensor: writing into the residual it reads made o_proj 12.3 instead of 10.0 us and down 32.0
    instead of 27.9 on an H200 (benchmarks/row_gemv_microbench.py). cuBLAS (beta = 1) updates
    `residual` in place and returns it: out of place it would copy the residual first."""
    if x.is_cuda and ROW_GEMV:
        gemv, _ = _kernels()
        if gemv.use_row_gemv(x, weight):
            return gemv.row_gemv(x, weight, residual=residual)
    return residual.addmm_(x, weight.t())


def _cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.dtype == torch.float32:
        blocks = blocks_for_rows(weight, x.shape[0])
        if blocks is not None:
            return quantized_linear(x, blocks, bias)
    if getattr(weight, _PACKED_ATTR, False):
        plain = getattr(weight, _PLAIN_ATTR, None)
        if plain is not None and x.shape[0] == 1:
            return F.linear(x, plain, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
