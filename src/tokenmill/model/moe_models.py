"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and Qwen3-MoE.

They are the dense decoder (llama.py: attention with Qwen3's Q/K norm or Qwen2's q/k/v bias as
ArchConfig says) whose sparse layers (MoEConfig.sparse_layers) have a SparseMoEBlock
(layers/moe.py) where the dense ones have the SwiGLU MLP; `make_mlp` is the one hook.

Checkpoint names. Published checkpoints store one tensor per expert:
  Mixtral   model.layers.L.block_sparse_moe.gate.weight, ...block_sparse_moe.experts.E.w1|w3|w2.weight
  Qwen-MoE  model.layers.L.mlp.gate.weight, ...mlp.experts.E.gate_proj|up_proj|down_proj.weight,
            ...mlp.shared_expert.gate_proj|up_proj|down_proj.weight, ...mlp.shared_expert_gate.weight
transformers 5 keeps the experts stacked in memory and writes them so with
`save_pretrained(save_original_format=False)`: ...mlp.experts.gate_up_proj [E, 2I, H] (gate rows
first) and ...mlp.experts.down_proj [E, H, I], Mixtral's block named `mlp` too. Both load: names
are first brought to the Qwen per-expert spelling (`_per_expert_tensors`, stacked tensors split
into per-expert views), which is also the spelling of the names the loader expects.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.layers.moe import SparseMoEBlock, select_moe_ops
from tokenmill.model.layers.moe_fp8 import Fp8ExpertWeights
from tokenmill.model.layers.moe_int4 import Int4ExpertWeights
from tokenmill.model.layers.quantized_method import QuantizedLinearMethod
from tokenmill.model.llama import CausalLM

_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

_MIXTRAL_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.(\w+)")
_MIXTRAL_BLOCK = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(.+)")
_STACKED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)")
# An FP8 expert projection's tensor -> the MoEExperts parameter (of gate_up_* / down_*) it fills;
# a 4-bit one's go to "<projection>:<leaf>" (layers/moe_int4.py keeps them until all have loaded).
_EXPERT_LEAF_PARAM = {"weight": "proj", "weight_scale": "scale", "weight_scale_inv": "scale", "input_scale": "input_scale"}
_SHARED_GATE_UP = re.compile(r"model\.layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj)\.(\w+)")


class MoECausalLM(CausalLM):
    # The CUDA MoE ops read nothing back to the host (routing, alignment and the grouped GEMMs'
    # grids depend only on the token count), so the layers between attention calls capture as
    # they are (tests/gpu/test_piecewise_graphs_gpu.py).
    supports_piecewise_graphs = True
    # Sharded: attention as llama's; each expert's intermediate dimension split over the ranks
    # (layers/moe.py), the router whole, one all-reduce after the block.
    supports_tensor_parallel = True

    def make_mlp(
        self, layer: int, linear_method: LinearMethod | None, device, dtype: torch.dtype
    ) -> nn.Module | None:
        moe = self.arch.moe
        if moe is None:
            raise ValueError(f"{self.arch.architecture} config has no mixture-of-experts section")
        if not moe.is_sparse(layer):
            return None  # mlp_only_layers / decoder_sparse_step: the dense MLP
        if "moe_ops" not in self.__dict__:
            self.moe_ops = select_moe_ops(device or "cpu", self.kernel.cpu_gemv16)  # once per model, like the layer ops
        expert_quant = None
        if isinstance(linear_method, QuantizedLinearMethod):
            # The linear method's spec, for the routed experts too.
            spec, use_kernels = linear_method.spec, linear_method.use_kernels
            weights = Fp8ExpertWeights if spec.scheme == "fp8_w8a8" else Int4ExpertWeights
            expert_quant = weights(spec, use_kernels=use_kernels)
            self.expert_quant = expert_quant
        return SparseMoEBlock(
            self.arch.hidden_size, moe, self.ops, self.moe_ops, linear_method=linear_method,
            expert_quant=expert_quant, device=device, dtype=dtype, tp_rank=self.tp_rank, tp_size=self.tp_size,
        )  # fmt: skip

    def _expert_leaves(self, accepted: bool = False) -> tuple[str, ...]:
        """The tensors besides `weight` each quantized expert projection has in the checkpoint (with
        `accepted`, the optional ones too)."""
        quant = self.__dict__.get("expert_quant")
        if quant is None:
            return ()
        return quant.accepted_leaves() if accepted else quant.checkpoint_leaves()

    def _expert_weight_leaves(self) -> tuple[str, ...]:
        """Every tensor each expert projection must have: its weight (16-bit or FP8) and scales, or
        a 4-bit checkpoint's packed tensors instead of the weight."""
        quant = self.__dict__.get("expert_quant")
        if isinstance(quant, Int4ExpertWeights) and quant.format is not None:
            return quant.checkpoint_leaves()
        return ("weight", *self._expert_leaves())

    def _checkpoint_target(self, name: str):
        # A 4-bit expert's tensors go to "<projection>:<leaf>", which is no attribute to check.
        match = _EXPERT.fullmatch(name)
        if match is not None and isinstance(self.__dict__.get("expert_quant"), Int4ExpertWeights):
            return self._checkpoint_module(name)
        return super()._checkpoint_target(name)

    # -- loading ------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert_tensors(weights))

    def _checkpoint_module(self, name: str):
        match = _EXPERT.fullmatch(name)
        if match is not None:
            block = self._sparse_block(int(match[1]), name)
            expert, part, leaf = int(match[2]), match[3], match[4]
            quant = block.experts.quant
            int4_checkpoint = isinstance(quant, Int4ExpertWeights) and quant.format is not None
            takes = self._expert_leaves(accepted=True) if int4_checkpoint else ("weight", *self._expert_leaves(True))
            if leaf not in takes:
                raise ValueError(f"unexpected weight {name!r}: this model's experts take {', '.join(takes)} tensors")
            shard = (expert, None) if part == "down_proj" else (expert, _EXPERT_PARTS.index(part))
            projection = "down_proj" if part == "down_proj" else "gate_up_proj"
            if int4_checkpoint:
                return block.experts, f"{projection}:{leaf}", shard
            return block.experts, f"{projection.removesuffix('_proj')}_{_EXPERT_LEAF_PARAM[leaf]}", shard
        match = _SHARED_GATE_UP.fullmatch(name)
        if match is not None:
            block = self._sparse_block(int(match[1]), name)
            if block.shared_expert is None:
                raise ValueError(f"unexpected weight {name!r}: this {self.arch.architecture} model has no shared expert")
            return block.shared_expert.gate_up_proj, match[3], _EXPERT_PARTS.index(match[2])
        return super()._checkpoint_module(name)

    def _sparse_block(self, layer: int, name: str) -> SparseMoEBlock:
        mlp = self.layers[layer].mlp if layer < len(self.layers) else None
        if not isinstance(mlp, SparseMoEBlock):
            raise ValueError(
                f"unexpected weight {name!r}: layer {layer} of this {self.arch.architecture} model has no experts"
            )
        return mlp

    def _expected_weight_names(self) -> set[str]:
        names = super()._expected_weight_names()
        moe = self.arch.moe
        assert moe is not None  # make_mlp refused a model without one
        for layer in moe.sparse_layers:
            prefix = f"model.layers.{layer}.mlp."
            names -= {prefix + f"{part}.weight" for part in _EXPERT_PARTS}  # no dense MLP here
            names.add(prefix + "gate.weight")
            names.update(
                prefix + f"experts.{e}.{part}.{leaf}"
                for e in range(moe.num_experts)
                for part in _EXPERT_PARTS
                for leaf in self._expert_weight_leaves()
            )
            if moe.shared_expert_intermediate_size:
                names.update(prefix + f"shared_expert.{part}.weight" for part in _EXPERT_PARTS)
                names.add(prefix + "shared_expert_gate.weight")
        return names


def _per_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors under Qwen's per-expert names: Mixtral's renamed, stacked expert
    tensors split into views of one expert's gate, up and down matrices."""
    for name, tensor in weights:
        match = _MIXTRAL_EXPERT.fullmatch(name)
        if match is not None:
            layer, expert, part, leaf = match.groups()
            yield f"model.layers.{layer}.mlp.experts.{expert}.{_MIXTRAL_EXPERT_PARTS[part]}.{leaf}", tensor
            continue
        match = _MIXTRAL_BLOCK.fullmatch(name)
        if match is not None:
            name = f"{match[1]}mlp.{match[2]}"
        match = _STACKED_EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        layer, stacked = match.groups()
        if tensor.dim() != 3:
            raise ValueError(f"weight {name}: expected a stacked [experts, out, in] tensor, got {tuple(tensor.shape)}")
        prefix = f"model.layers.{layer}.mlp.experts."
        for expert, matrix in enumerate(tensor.unbind(0)):
            if stacked == "down_proj":
                yield prefix + f"{expert}.down_proj.weight", matrix
            else:
                gate, up = matrix.chunk(2, dim=0)
                yield prefix + f"{expert}.gate_proj.weight", gate
                yield prefix + f"{expert}.up_proj.weight", up
