"""What the GPU a model loads on can run: checked at load, so an old GPU gets an error naming what
it lacks and what runs there, instead of a Triton compile error or a cuBLAS failure in the first
step."""

from __future__ import annotations

import torch

FP8_MIN_CAPABILITY = (8, 9)  # float8 e4m3 arithmetic and conversions: Ada, Hopper and newer


def require_fp8_capable(device: torch.device, what: str, instead: str) -> None:
    """Refuse `what` (FP8 weights, an FP8 KV cache) on a CUDA device older than compute capability
    8.9, saying what to do `instead`."""
    if device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"{what}: float8 e4m3 arithmetic needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
            f"Blackwell); {device} ({name}) is {major}.{minor}. {instead}"
        )
