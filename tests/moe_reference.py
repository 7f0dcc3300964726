"""The float32 reference the fused MoE kernel tests hold their outputs to: random routes and a loop
over the experts on (dequantized) weights, as transformers' eager experts loop computes them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def distinct_routes(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int32): distinct experts per token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    return torch.rand(num_tokens, top_k, generator=gen), ids.to(torch.int32)


def loop_over_experts(x, gate_up, down, weights, ids) -> torch.Tensor:
    """Per expert, its tokens' gate/up, SiLU-and-mul, down, weighted and index_add-ed, in float32."""
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for expert in range(gate_up.shape[0]):
        token, slot = torch.nonzero(ids.long() == expert, as_tuple=True)
        if token.numel() == 0:
            continue
        h = F.linear(x[token].float(), gate_up[expert].float())
        y = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down[expert].float())
        out.index_add_(0, token, y * weights[token, slot, None].float())
    return out


def assert_close_to_loop(out: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: sums in another order (1e-5 of the output's size); bf16: the kernels round (the
    weights,) gate/up, the activation and the outputs, the float32 loop does not (2e-2, as the
    16-bit tests allow)."""
    tolerance = (1e-5 if out.dtype == torch.float32 else 2e-2) * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
