"""Random INT4 weights in the canonical form (kernels/triton/int4_pack.py) and their float32
dequantization, for the INT4 kernel tests (CPU and GPU) and nothing else."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class CanonicalInt4:
    q: torch.Tensor  # uint8 [N, K], 0..15
    scales: torch.Tensor  # 16-bit [N, G]
    zeros: torch.Tensor  # uint8 [N, G]
    group_size: int  # -1: per-channel
    g_idx: torch.Tensor | None  # int32 [K], None: k // group_size

    def dequantize(self) -> torch.Tensor:
        """W[n, k] = (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)] in float32 (exact)."""
        n, k = self.q.shape
        if self.g_idx is not None:
            group = self.g_idx.long()
        elif self.group_size == -1:
            group = torch.zeros(k, dtype=torch.long, device=self.q.device)
        else:
            group = torch.arange(k, device=self.q.device) // self.group_size
        return (self.q.float() - self.zeros.float()[:, group]) * self.scales.float()[:, group]


def random_int4(
    n: int,
    k: int,
    group_size: int,
    *,
    act_order: bool = False,
    symmetric: bool = False,
    scale_dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> CanonicalInt4:
    """Weights whose dequantized rows have about unit norm per input feature (x @ W.T stays O(1) for
    unit x); act_order shuffles g_idx as GPTQ's desc_act does (groups of group_size columns, in a
    random column order); symmetric puts every zero point at 8 (GPTQ sym), else random (AWQ)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_groups = 1 if group_size == -1 else -(-k // group_size)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8, device=device)
    scales = ((torch.rand(n, num_groups, generator=gen, device=device) + 0.5) / (4 * k**0.5)).to(scale_dtype)
    if symmetric:
        zeros = torch.full((n, num_groups), 8, dtype=torch.uint8, device=device)
    else:
        zeros = torch.randint(0, 16, (n, num_groups), generator=gen, dtype=torch.uint8, device=device)
    g_idx = None
    if act_order:
        order = torch.randperm(k, generator=gen, device=device)
        g_idx = (torch.arange(k, device=device) // group_size)[order].to(torch.int32)
    return CanonicalInt4(q=q, scales=scales, zeros=zeros, group_size=group_size, g_idx=g_idx)
