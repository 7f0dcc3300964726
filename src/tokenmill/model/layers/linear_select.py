"""select_linear_method: the one place a weight format picks its linear method.

Chosen once at load from the device, the dtype, the checkpoint's quantization and KernelConfig:
the 16-bit method of the device, or a quantized method (FP8 W8A8, INT4 W4A16) around it, which
the layers left unquantized (lm_head, a checkpoint's ignore list) then take instead
(`exclude_unquantized_layers`). The GGUF blocks, which come beside float weights, wrap the chosen
method after loading (layers/quantized_linear.py attach_quantized_blocks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.config import KernelConfig
from tokenmill.gpu_capability import require_fp8_capable
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.loader.quant_config import QuantizationSpec

if TYPE_CHECKING:
    from torch import nn


def select_linear_method(
    device: torch.device | str,
    dtype: torch.dtype,
    kernel: KernelConfig,
    quantization: QuantizationSpec | None = None,
) -> LinearMethod:
    base = _select_16bit_method(torch.device(device), dtype, kernel)
    if quantization is None:
        return base
    use_kernels = torch.device(device).type == "cuda"
    if use_kernels and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"{quantization.method} weights on a GPU run with 16-bit activations; got dtype "
            f"{str(dtype).removeprefix('torch.')}: use --dtype bfloat16 or float16"
        )
    if quantization.scheme == "fp8_w8a8":
        from tokenmill.model.layers.fp8_linear import Fp8LinearMethod

        if use_kernels:
            require_fp8_capable(
                torch.device(device), f"FP8 weights ({quantization.method})",
                "Serve the 16-bit checkpoint, or a 4-bit one (AWQ / GPTQ, or --quantization awq), which runs on this GPU",
            )  # fmt: skip

        return Fp8LinearMethod(quantization, base, use_kernels=use_kernels, kernel=kernel)
    from tokenmill.model.layers.int4_linear import Int4LinearMethod

    return Int4LinearMethod(quantization, base, use_kernels=use_kernels, kernel=kernel)


def exclude_unquantized_layers(
    model: nn.Module, hf_names: dict[int, list[str]], device: torch.device, dtype: torch.dtype
) -> int:
    """Give the 16-bit method back to the linear layers a quantized method must not take: lm_head,
    and those the spec's ignore list names. `hf_names`: id(layer) -> the HF module names it loads.
    Returns how many layers stay 16-bit. Call before loading: their weights are re-created."""
    from tokenmill.model.layers.linear import linear_layers
    from tokenmill.model.layers.quantized_method import QuantizedLinearMethod

    kept = 0
    for layer in linear_layers(model):
        method = layer.method
        if not isinstance(method, QuantizedLinearMethod):
            continue
        names = hf_names.get(id(layer), [])
        ignored = [name == "lm_head" or method.spec.is_ignored(name) for name in names]
        if not any(ignored):
            continue
        if not all(ignored):
            raise ValueError(
                f"the quantization config leaves {[n for n, i in zip(names, ignored, strict=True) if i]} "
                f"unquantized but not {[n for n, i in zip(names, ignored, strict=True) if not i]}, and "
                "tokenmill multiplies them as one merged layer"
            )
        layer.method = method.base
        kept += 1
        if layer.weight_is_shared:
            continue
        layer.forget_checkpoint_params()
        layer.checkpoint_params = ("weight",)
        method.base.create_weights(layer, layer.in_features, layer.out_features, device=device, dtype=dtype)
    return kept


def _select_16bit_method(device: torch.device, dtype: torch.dtype, kernel: KernelConfig) -> LinearMethod:
    if device.type == "cuda":
        from tokenmill.model.layers.cuda_linear import CudaLinearMethod

        return CudaLinearMethod(row_gemv=kernel.row_gemv, skinny_gemm=kernel.skinny_gemm)
    if device.type == "cpu" and kernel.cpu_weight_packing:
        from tokenmill.model.layers.onednn_linear import OneDNNLinearMethod, onednn_packing_available

        if onednn_packing_available(dtype):
            return OneDNNLinearMethod()
    if device.type == "cpu" and kernel.cpu_gemv16 and dtype in (torch.bfloat16, torch.float16):
        from tokenmill.model.layers.cpu_gemv16_linear import Cpu16BitGemvMethod

        return Cpu16BitGemvMethod()
    return LinearMethod()
