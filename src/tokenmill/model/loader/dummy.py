"""Random weights at a real architecture's shapes, for benchmarks (throughput ignores values)."""

from __future__ import annotations

import torch
from torch import nn

# Small enough that activations stay finite through many layers in bf16, large enough that
# logits are not all equal.
_WEIGHT_STD = 0.02


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place, generating on the parameter's device (fast on GPU)."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(device=param.device)
            gen.manual_seed(seed)
        if "norm" in name:
            param.fill_(1.0)
        else:  # matrices and biases
            param.normal_(0.0, _WEIGHT_STD, generator=gen)
