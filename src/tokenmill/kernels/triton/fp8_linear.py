"""FP8 (e4m3) weight matmuls on the GPU: the kernel entry points the FP8 linear method calls.

`prepare_fp8_weights` puts a layer's FP8 weight and float32 scales in the form every path below
reads, once at load: the out-major [N, K] weight contiguous (a row per output feature: the
few-row kernels stream it, and its transpose is the column-major B operand `torch._scaled_mm`
needs, so one copy serves all paths) and the scales float32 contiguous.

`fp8_linear` picks a path from the number of rows M and the width N (thresholds measured on an
H100 with benchmarks/fp8_linear_microbench.py; results in benchmarks/results/):
- `tc16`: fp8_tc_gemv.py, per-channel weights, 1 row when asked for (KernelConfig
  fp8_tensor_core_gemv, off by default: not yet measured on a GPU): the weights converted to
  float16 in registers, multiplied on the tensor cores with 16-bit activations, K split;
- `gemv`: fp8_gemv.py, CUDA-core GEMV with 16-bit activations (one or two requests decoding);
- `skinny16`: fp8_skinny.py, tensor-core tiles with 16-bit activations, the FP8 weight converted
  in registers: no activation quantization, as `gemv`, but slower than `skinny8` at every size
  measured, so only chosen through an Fp8Dispatch that asks for it;
- `skinny8`: fp8_skinny.py with activations quantized per token (or per 1x128 group): a few
  requests decoding;
- `scaled_mm` (per-channel weights): activations quantized per token, then cuBLASLt through
  `torch._scaled_mm` with row-wise scales;
- `gemm`: fp8_gemm.py, the Triton W8A8 GEMM (block weights; per channel where
  `torch._scaled_mm` does not apply).
(cuBLASLt's 1x128 x 128x128 block scaling through `torch.nn.functional.scaled_mm` answered
CUBLAS_STATUS_NOT_SUPPORTED on an H100 with torch 2.11 + CUDA 13.0 for the one layout tried:
activation scales [M, K/128] column-major, weight scales padded to [L4, N/128] with strides
(1, L4). Block weights have no cuBLAS path for now.)
Every path is capturable in a CUDA graph: outputs are allocated from shapes, nothing is read back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.kernels.triton.fp8_gemm import fp8_gemm
from tokenmill.kernels.triton.fp8_gemv import MAX_ROWS as GEMV_MAX_ROWS
from tokenmill.kernels.triton.fp8_gemv import fp8_gemv
from tokenmill.kernels.triton.fp8_quant import FP8_DTYPE, quantize_per_token, quantize_per_token_group
from tokenmill.kernels.triton.fp8_skinny import MAX_ROWS as SKINNY_MAX_ROWS
from tokenmill.kernels.triton.fp8_skinny import fp8_skinny
from tokenmill.kernels.triton.fp8_tc_gemv import MAX_ROWS as TC16_MAX_ROWS
from tokenmill.kernels.triton.fp8_tc_gemv import fp8_tc_gemv

SCALE_BLOCK = (128, 128)  # the block-wise layout published checkpoints use (DeepSeek-V3, Qwen3-FP8)


@dataclass(frozen=True, slots=True)
class Fp8Weights:
    """One layer's FP8 weight in kernel-ready form (see prepare_fp8_weights)."""

    weight: torch.Tensor  # float8_e4m3fn [N, K], contiguous
    scale: torch.Tensor  # float32: [N] per channel, or [cdiv(N, 128), cdiv(K, 128)] per block, contiguous
    block: tuple[int, int] | None  # None: per channel; else SCALE_BLOCK
    scale_row: torch.Tensor | None  # per channel: scale as [1, N] (torch._scaled_mm's scale_b), else None
    # int32, zero between calls: the K-split GEMV's arrival count per column tile (fp8_gemv.py),
    # one per output feature (enough for any tile width).
    tile_counters: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


def prepare_fp8_weights(
    weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None
) -> Fp8Weights:
    """`weight` float8_e4m3fn [N, K] (out x in) and its float32 `weight_scale`: per channel [N]
    (or [N, 1]) with block None, or [cdiv(N, 128), cdiv(K, 128)] with block (128, 128); the
    dequantized weight is weight.float() times the scale of each element's channel / block."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2:
        raise ValueError(f"FP8 weights must be float8_e4m3fn [N, K], got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    if block is None:
        if weight_scale.numel() != n or weight_scale.dim() not in (1, 2):
            raise ValueError(
                f"a per-channel FP8 weight [{n}, {k}] needs {n} scales ([N] or [N, 1]), got {tuple(weight_scale.shape)}"
            )
        scale = weight_scale.reshape(n)
    else:
        if tuple(block) != SCALE_BLOCK:
            raise ValueError(f"FP8 block scales are supported for blocks {SCALE_BLOCK}, got {tuple(block)}")
        expected = (-(-n // block[0]), -(-k // block[1]))
        if tuple(weight_scale.shape) != expected:
            raise ValueError(
                f"an FP8 weight [{n}, {k}] with {block} blocks needs scales {expected}, got {tuple(weight_scale.shape)}"
            )
        scale = weight_scale
    if weight_scale.device != weight.device:
        raise ValueError(f"FP8 weight on {weight.device} but its scales on {weight_scale.device}")
    scale = scale.to(torch.float32).contiguous()
    return Fp8Weights(
        weight=weight.contiguous(),
        scale=scale,
        block=None if block is None else SCALE_BLOCK,
        scale_row=scale.view(1, n) if block is None else None,
        tile_counters=torch.zeros(n, dtype=torch.int32, device=weight.device),
    )


# -- the paths: each (x [M, K] 16-bit contiguous, w, bias, residual [M, N] | None, out_dtype) --------


def _gemv(x, w: Fp8Weights, bias, residual, out_dtype) -> torch.Tensor:
    # With a residual, a new output tensor: faster than writing into the residual (fp8_gemv.py).
    return fp8_gemv(
        x, w.weight, w.scale, w.block, bias, residual, out_dtype=out_dtype, tile_counters=w.tile_counters
    )


def _tc16(x, w: Fp8Weights, bias, residual, out_dtype) -> torch.Tensor:
    # Per-channel weights only (choose_path); a new output tensor, as the GEMV.
    return fp8_tc_gemv(x, w.weight, w.scale, w.tile_counters, bias, residual, out_dtype=out_dtype)


def _skinny16(x, w: Fp8Weights, bias, residual, out_dtype) -> torch.Tensor:
    return fp8_skinny(x, None, w.weight, w.scale, w.block, bias, residual, out=residual, out_dtype=out_dtype)


def _quantize(x: torch.Tensor, w: Fp8Weights) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_per_token(x) if w.block is None else quantize_per_token_group(x, SCALE_BLOCK[1])


def _skinny8(x, w: Fp8Weights, bias, residual, out_dtype) -> torch.Tensor:
    xq, x_scale = _quantize(x, w)
    return fp8_skinny(xq, x_scale, w.weight, w.scale, w.block, bias, residual, out=residual, out_dtype=out_dtype)


def _gemm(x, w: Fp8Weights, bias, residual, out_dtype) -> torch.Tensor:
    xq, x_scale = _quantize(x, w)
    return fp8_gemm(xq, x_scale, w.weight, w.scale, w.block, bias, residual, out=residual, out_dtype=out_dtype)


def _scaled_mm(x, w: Fp8Weights, bias, residual, out_dtype) -> torch.Tensor:
    """cuBLASLt's FP8 GEMM with row-wise scales (per-channel weights only). Its bias must be in
    the output dtype, and it has no residual input: those are added after."""
    xq, x_scale = quantize_per_token(x)
    fused_bias = bias if bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32 else None
    y = torch._scaled_mm(
        xq, w.weight.t(), scale_a=x_scale, scale_b=w.scale_row, bias=fused_bias, out_dtype=out_dtype
    )
    if bias is not None and fused_bias is None:
        y += bias
    return y if residual is None else residual.add_(y)


PATHS: dict[str, Callable[..., torch.Tensor]] = {
    "tc16": _tc16,
    "gemv": _gemv,
    "skinny16": _skinny16,
    "skinny8": _skinny8,
    "scaled_mm": _scaled_mm,
    "gemm": _gemm,
}


@dataclass(frozen=True, slots=True)
class Fp8Dispatch:
    """The largest M each few-row path takes (checked in this order; 0: never); larger M go to the
    W8A8 GEMMs. Wide matrices (N > wide_n: gate_up, lm_head) leave the GEMV sooner."""

    # Per-channel weights: the tensor-core W8A16 GEMV (fp8_tc_gemv.py) from tc16_min_rows to
    # tc16_max_rows rows, before the CUDA-core one. H200, Llama-3.1-8B shapes
    # (fp8_linear_microbench.py, 2026-12-05): at 2 rows it beat the path it replaced on every
    # projection (qkv 10.8 vs 13.3 us, o_proj 8.9 vs 9.4, gate_up 32.9 vs 40.7 on skinny8, down
    # 19.8 vs 25.5); at 1 row the CUDA-core GEMV stayed ahead (8.9 vs 10.5 us on qkv), so one row
    # goes to tc16 only when KernelConfig.fp8_tensor_core_gemv asks (tc16_min_rows=1). 3-4 rows
    # (the kernel takes up to 4) stay on the paths before it until measured there.
    tc16_min_rows: int = 2
    tc16_max_rows: int = 2
    gemv_max_rows: int = 2
    gemv_max_rows_wide: int = 1
    wide_n: int = 16384
    skinny16_max_rows: int = 0
    skinny8_max_rows: int = 64

    def __post_init__(self) -> None:
        if (
            self.tc16_min_rows < 1
            or self.tc16_max_rows > TC16_MAX_ROWS
            or max(self.gemv_max_rows, self.gemv_max_rows_wide) > GEMV_MAX_ROWS
            or max(self.skinny16_max_rows, self.skinny8_max_rows) > SKINNY_MAX_ROWS
        ):
            raise ValueError(
                f"{self} exceeds the kernels' row limits ({TC16_MAX_ROWS}, {GEMV_MAX_ROWS}, {SKINNY_MAX_ROWS})"
            )


DISPATCH = Fp8Dispatch()


def scaled_mm_applies(x: torch.Tensor, w: Fp8Weights) -> bool:
    """Whether torch._scaled_mm can serve this product: per-channel scales, CUDA, dimensions
    multiples of 16 (cuBLASLt's FP8 alignment)."""
    return w.block is None and x.is_cuda and w.in_features % 16 == 0 and w.out_features % 16 == 0


def choose_path(x: torch.Tensor, w: Fp8Weights, dispatch: Fp8Dispatch = DISPATCH) -> str:
    """The name (a key of PATHS) of the path fp8_linear takes for x [M, K]."""
    m = x.shape[0]
    wide = w.out_features > dispatch.wide_n
    if dispatch.tc16_min_rows <= m <= dispatch.tc16_max_rows and w.block is None:
        return "tc16"
    if m <= (dispatch.gemv_max_rows_wide if wide else dispatch.gemv_max_rows):
        return "gemv"
    if m <= dispatch.skinny16_max_rows:
        return "skinny16"
    if m <= dispatch.skinny8_max_rows:
        return "skinny8"
    return "scaled_mm" if scaled_mm_applies(x, w) else "gemm"


def fp8_linear(
    x: torch.Tensor,
    w: Fp8Weights,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    path: str | None = None,
    dispatch: Fp8Dispatch | None = None,
) -> torch.Tensor:
    """`x @ W.T + bias` (W the dequantized FP8 weight) converted to `out_dtype` (default x's), for
    x [..., K] bfloat16 or float16; with `residual` [..., N], `residual + that` in `residual`'s
    dtype, returned: written into `residual` except on the `gemv` and `tc16` paths, which return a
    new tensor (faster at one row, as the 16-bit row GEMV). `path` (a key of PATHS) overrides the
    choice by M, for tests and benchmarks; `dispatch` replaces the default thresholds (DISPATCH)."""
    k, n = w.in_features, w.out_features
    if x.dtype not in (torch.bfloat16, torch.float16) or x.shape[-1] != k:
        raise ValueError(f"fp8_linear takes bfloat16 / float16 x [..., {k}], got {x.dtype} {tuple(x.shape)}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < k):
        x2 = x2.contiguous()
    if residual is not None:
        if tuple(residual.shape) != (*lead, n):
            raise ValueError(f"residual must be {(*lead, n)} for x {tuple(x.shape)}, got {tuple(residual.shape)}")
        if out_dtype is not None and out_dtype != residual.dtype:
            raise ValueError(f"with a residual the output is the residual's {residual.dtype}, not {out_dtype}")
        out_dtype = residual.dtype
        res2 = residual.view(-1, n)
        if res2.stride(1) != 1:
            raise ValueError(f"residual must be contiguous in its last dimension, got strides {residual.stride()}")
    else:
        res2 = None
        out_dtype = out_dtype or x.dtype
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    if x2.shape[0] == 0:
        return residual if residual is not None else x.new_empty((*lead, n), dtype=out_dtype)
    y = PATHS[path or choose_path(x2, w, dispatch or DISPATCH)](x2, w, bias, res2, out_dtype)
    return y.view(*lead, n)
