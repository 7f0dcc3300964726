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
from tokenmill.model.layers.quantized_method import QuantizedLinearMethod
from tokenmill.model.llama import CausalLM

_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

_MIXTRAL_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\."
    r"(weight|weight_scale|weight_scale_inv|input_scale)"
)
_MIXTRAL_BLOCK = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(.+)")
_STACKED_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\."
    r"(weight|weight_scale|weight_scale_inv|input_scale)"
)
# An FP8 expert projection's tensor -> the MoEExperts parameter (of gate_up_* / down_*) it fills.
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
            self.moe_ops = select_moe_ops(device or "cpu")  # once per model, like the layer ops
        expert_fp8 = None
        if isinstance(linear_method, QuantizedLinearMethod):
            # The FP8 linear method's spec, for the routed experts too (resolve_model refused the rest).
            expert_fp8 = Fp8ExpertWeights(linear_method.spec, use_kernels=linear_method.use_kernels)
            self.expert_fp8 = expert_fp8
        return SparseMoEBlock(
            self.arch.hidden_size, moe, self.ops, self.moe_ops, linear_method=linear_method,
            expert_fp8=expert_fp8, device=device, dtype=dtype, tp_rank=self.tp_rank, tp_size=self.tp_size,
        )  # fmt: skip

    def _expert_leaves(self) -> tuple[str, ...]:
        """The tensors besides `weight` each FP8 expert projection has in the checkpoint."""
        fp8 = self.__dict__.get("expert_fp8")
        return fp8.checkpoint_leaves() if fp8 is not None else ()

    # -- loading ------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_per_expert_tensors(weights))

    def _checkpoint_module(self, name: str):
        match = _EXPERT.fullmatch(name)
        if match is not None:
            block = self._sparse_block(int(match[1]), name)
            expert, part, leaf = int(match[2]), match[3], match[4]
            if leaf != "weight" and (block.experts.fp8 is None or leaf not in self._expert_leaves()):
                raise ValueError(
                    f"unexpected weight {name!r}: this model's experts take "
                    f"{', '.join(('weight',) + self._expert_leaves())} tensors"
                )
            param = _EXPERT_LEAF_PARAM[leaf]
            if part == "down_proj":
                return block.experts, f"down_{param}", (expert, None)
            return block.experts, f"gate_up_{param}", (expert, _EXPERT_PARTS.index(part))
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
                for leaf in ("weight", *self._expert_leaves())
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
