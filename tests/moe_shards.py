"""A sparse MoE block (routed experts + a shared expert) built whole and as the two shards of
tensor parallelism from the same random weights, for checks that run in one process: there the
all-reduce is the identity, so each rank's block returns its partial sum and the ranks' outputs
must add up to the whole block's."""

from __future__ import annotations

import dataclasses

import torch

from tokenmill.model.layers.layer_ops import select_layer_ops
from tokenmill.model.layers.moe import MoEOps, SparseMoEBlock
from tokenmill.model.moe_config import MoEConfig

HIDDEN = 32


def moe_config(**overrides) -> MoEConfig:
    base = MoEConfig(
        num_experts=4, top_k=2, expert_intermediate_size=32, renormalize=False, sparse_layers=(0, 1),
        shared_expert_intermediate_size=40,
    )  # fmt: skip
    return dataclasses.replace(base, **overrides)


@torch.no_grad()
def sharded_moe_blocks(
    moe_ops: MoEOps, seed: int = 0
) -> tuple[SparseMoEBlock, list[SparseMoEBlock], torch.Tensor]:
    """(the whole block, rank 0's and rank 1's blocks of 2, an input [7, HIDDEN]). Rank 0 loads
    the experts one tensor at a time, rank 1 as transformers 5's stacked tensors."""
    moe = moe_config()
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * 0.2

    inter, shared_inter = moe.expert_intermediate_size, moe.shared_expert_intermediate_size
    experts = [(rand(inter, HIDDEN), rand(inter, HIDDEN), rand(HIDDEN, inter)) for _ in range(moe.num_experts)]
    router, shared_gate = rand(moe.num_experts, HIDDEN), rand(1, HIDDEN)
    shared = (rand(shared_inter, HIDDEN), rand(shared_inter, HIDDEN), rand(HIDDEN, shared_inter))

    def block(rank: int, size: int, stacked: bool) -> SparseMoEBlock:
        b = SparseMoEBlock(HIDDEN, moe, select_layer_ops("cpu"), moe_ops, tp_rank=rank, tp_size=size)
        b.gate.weight_loader("weight", router)
        b.shared_expert_gate.weight_loader("weight", shared_gate)
        for part, tensor in enumerate(shared[:2]):
            b.shared_expert.gate_up_proj.weight_loader("weight", tensor, part)
        b.shared_expert.down_proj.weight_loader("weight", shared[2])
        if stacked:
            b.experts.weight_loader("gate_up_proj", torch.stack([torch.cat(e[:2]) for e in experts]))
            b.experts.weight_loader("down_proj", torch.stack([e[2] for e in experts]))
        else:
            for index, (gate, up, down) in enumerate(experts):
                b.experts.weight_loader("gate_up_proj", gate, (index, 0))
                b.experts.weight_loader("gate_up_proj", up, (index, 1))
                b.experts.weight_loader("down_proj", down, (index, None))
        return b

    return block(0, 1, stacked=False), [block(0, 2, stacked=False), block(1, 2, stacked=True)], rand(7, HIDDEN)
