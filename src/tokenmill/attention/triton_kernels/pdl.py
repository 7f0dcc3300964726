"""Programmatic dependent launch (Hopper and later) for the small kernels that follow a matmul.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is
still finishing; it must call `gdc_wait()` before it reads anything that kernel writes. Work
before the wait (reading the step's metadata, exiting programs that have nothing to do,
reading tensors written by earlier kernels) overlaps the previous kernel's tail, and the gap
between the two launches shrinks. Inside CUDA graphs the dependency becomes a programmatic
edge. TOKENMILL_PDL=0 turns it off, for same-run comparisons.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_wait as _gdc_wait
except ImportError:  # an older Triton: launches stay plain (uses_pdl says False)
    _gdc_wait = None

_ENABLED = os.environ.get("TOKENMILL_PDL", "1") != "0"


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With PDL, block until the previous kernel in the stream has finished and its writes are
    visible; otherwise nothing (stream order already guarantees it)."""
    if PDL:
        _gdc_wait()


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def uses_pdl(tensor: torch.Tensor) -> bool:
    """Whether kernels working on `tensor` launch with PDL: a CUDA tensor on a Hopper or newer
    GPU, a Triton that has gdc_wait, and TOKENMILL_PDL not 0."""
    return (
        _ENABLED
        and _gdc_wait is not None
        and tensor.is_cuda
        and _device_supports_pdl(tensor.device.index if tensor.device.index is not None else 0)
    )


def launch_options(pdl: bool) -> dict[str, bool]:
    """Extra launch keywords: `launch_pdl` only when on (the CPU interpreter takes no such option)."""
    return {"launch_pdl": True} if pdl else {}
