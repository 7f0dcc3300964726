"""select_linear_method: the one place a weight format picks its linear method.

Chosen once at load from the device, the dtype, the checkpoint's weight format and KernelConfig.
FP8 or INT4 checkpoints plug in here (a `quantization` argument and one more method class); the
GGUF blocks, which come beside float weights, wrap the chosen method after loading
(layers/quantized_linear.py attach_quantized_blocks).
"""

from __future__ import annotations

import torch

from tokenmill.config import KernelConfig
from tokenmill.model.layers.linear_method import LinearMethod


def select_linear_method(
    device: torch.device | str, dtype: torch.dtype, kernel: KernelConfig
) -> LinearMethod:
    device = torch.device(device)
    if device.type == "cuda":
        from tokenmill.model.layers.cuda_linear import CudaLinearMethod

        return CudaLinearMethod(row_gemv=kernel.row_gemv, skinny_gemm=kernel.skinny_gemm)
    if device.type == "cpu" and kernel.cpu_weight_packing:
        from tokenmill.model.layers.onednn_linear import OneDNNLinearMethod, onednn_packing_available

        if onednn_packing_available(dtype):
            return OneDNNLinearMethod()
    return LinearMethod()
