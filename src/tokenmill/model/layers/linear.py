"""Matmuls against weights prepacked for oneDNN on the CPU.

On the CPU, F.linear over a plain [out, in] float32 weight goes to MKL's sgemm, which is slow in
the middle of the decode batch range (a 3072x576 matmul at 16 rows took 1.96 ms against 0.46 ms
for the same weight prepacked; lm_head at 64 rows 55 ms against 41; measured on the 2-core dev
machine, see BENCHMARKS.md). oneDNN's linear takes a weight reordered once into its blocked
layout, the same size as the original, and works for any number of rows.

A packed weight replaces the module's parameter (an opaque oneDNN tensor cannot be a
Parameter's data) and is marked, so `linear` knows to route it; only `linear` may read it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_PACKED_ATTR = "onednn_packed"
# The row count oneDNN tunes the blocked layout for; the packed weight serves any row count.
_PACK_BATCH_HINT = 64


def onednn_packing_available(dtype: torch.dtype) -> bool:
    """float32 on a CPU build with oneDNN (bf16 packing only pays with AMX/AVX512-BF16; not tried)."""
    return (
        dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The oneDNN-packed copy of an [out, in] CPU weight, marked for `linear`."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH_HINT)
    setattr(packed, _PACKED_ATTR, True)
    return packed


def pack_parameter(module: torch.nn.Module, name: str) -> None:
    """Replace the weight parameter `name` of `module` by its packed form (same number of bytes)."""
    packed = pack_weight(getattr(module, name))
    del module._parameters[name]  # the original is freed; the attribute now holds the packed copy
    setattr(module, name, packed)


def is_packed(weight: torch.Tensor) -> bool:
    return getattr(weight, _PACKED_ATTR, False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or oneDNN's linear for a weight packed by this module."""
    if getattr(weight, _PACKED_ATTR, False):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
