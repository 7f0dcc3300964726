"""gpt-oss (`GptOssForCausalLM`): llama.py's decoder layer with gpt-oss's differences.

Attention has q/k/v/o biases and a learned sink per query head (`self_attn.sinks`, the layer's
AttentionLayerSpec.sinks, which the backend adds to each softmax's denominator); even layers slide
(`layer_types`, ArchConfig.sliding_windows); RoPE is YaRN (layers/rotary.py). Every layer's MLP is
GptOssMoEBlock (layers/gpt_oss_moe.py): router with bias, experts with biases and a clamped SwiGLU.

Checkpoint layout (what transformers' save_pretrained writes, and the BF16 releases):
  model.layers.L.self_attn.sinks                 [num_heads]
  model.layers.L.mlp.router.weight / .bias       [E, H] / [E]
  model.layers.L.mlp.experts.gate_up_proj        [E, H, 2I], gate and up columns interleaved
  model.layers.L.mlp.experts.gate_up_proj_bias   [E, 2I], interleaved the same way
  model.layers.L.mlp.experts.down_proj           [E, I, H]
  model.layers.L.mlp.experts.down_proj_bias      [E, H]
The loader transposes the expert matrices to MoEExperts' [E, 2I, H] / [E, H, I] and splits the
interleaved columns into gate rows then up rows. MXFP4 checkpoints (`_blocks` / `_scales`) are
refused before this, at resolve (model/loader/quant_config.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.attention.backend import AttentionLayerSpec
from tokenmill.config import KernelConfig
from tokenmill.model.layers.gpt_oss_moe import GptOssMoEBlock
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.llama import CausalLM, DecoderLayer

_EXPERT_TENSOR = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)"
)
_SINKS = re.compile(r"model\.layers\.(\d+)\.self_attn\.sinks")
_DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_MOE_WEIGHTS = (
    "self_attn.sinks",
    "mlp.router.weight",
    "mlp.router.bias",
    "mlp.experts.gate_up_proj",
    "mlp.experts.gate_up_proj_bias",
    "mlp.experts.down_proj",
    "mlp.experts.down_proj_bias",
)


class GptOssCausalLM(CausalLM):
    supports_piecewise_graphs = False  # not checked against piecewise CUDA graphs yet
    # Sharded: attention as llama's with each rank's query heads' sinks; the experts (and their
    # gate / up biases) cut along their intermediate dimension, the down bias added by rank 0 only.
    supports_tensor_parallel = True

    def _make_layer(
        self,
        index: int,
        kernel: KernelConfig,
        linear_method: LinearMethod | None,
        device: torch.device | str | None,
        dtype: torch.dtype,
    ) -> nn.Module:
        arch, moe = self.arch, self.arch.moe
        if moe is None or moe.clamped_swiglu is None:
            raise ValueError("a gpt_oss ArchConfig needs its MoEConfig (model/arch_gpt_oss.py builds it)")
        shard = {"tp_rank": self.tp_rank, "tp_size": self.tp_size}
        # One sink per query head of this rank (its slice of the checkpoint's: _sinks_of_this_rank).
        heads = arch.num_heads // self.tp_size
        sinks = nn.Parameter(torch.empty(heads, device=device, dtype=dtype), requires_grad=False)
        spec = AttentionLayerSpec(sliding_window=arch.layer_sliding_window(index), sinks=sinks)
        mlp = GptOssMoEBlock(
            arch.hidden_size, moe, linear_method=linear_method, device=device, dtype=dtype, **shard
        )
        layer = DecoderLayer(
            arch, self.attn_backend, self.ops, kernel, linear_method=linear_method, layer_spec=spec,
            device=device, dtype=dtype, mlp=mlp, **shard,
        )  # fmt: skip
        # Registered where the checkpoint names it; the spec holds the same tensor, which loading
        # fills in place.
        layer.self_attn.sinks = sinks
        return layer

    def fold_norm_weights(self) -> bool:
        """No folding: q/k/v biases, and the MoE block has no place for the norm's 1/rms."""
        return False

    # -- loading ------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._sinks_of_this_rank(_in_our_expert_layout(weights)))

    def _sinks_of_this_rank(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each layer's sinks [num_heads] cut to this rank's query heads (QKVParallelLinear's q split:
        rank r holds heads [r * h, (r + 1) * h)); a tensor of another size passes whole, and the
        loader reports it."""
        heads = self.arch.num_heads // self.tp_size
        for name, tensor in weights:
            if self.tp_size > 1 and _SINKS.fullmatch(name) and tensor.shape == (self.arch.num_heads,):
                tensor = tensor.narrow(0, self.tp_rank * heads, heads)
            yield name, tensor

    def _checkpoint_module(self, name: str):
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is not None:
            return self._layer(int(match[1]), name).mlp.experts, match[2], None
        match = _SINKS.fullmatch(name)
        if match is not None:
            return self._layer(int(match[1]), name).self_attn, "sinks", None
        return super()._checkpoint_module(name)

    def _layer(self, index: int, name: str) -> nn.Module:
        if index >= len(self.layers):
            raise ValueError(f"unexpected weight {name!r}: this model has {len(self.layers)} layers")
        return self.layers[index]

    def _expected_weight_names(self) -> set[str]:
        names = super()._expected_weight_names()
        for i in range(self.arch.num_layers):
            prefix = f"model.layers.{i}."
            names -= {prefix + n for n in _DENSE_MLP}
            names.update(prefix + n for n in _MOE_WEIGHTS)
        return names


def _in_our_expert_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert tensors from the checkpoint's layout (transposed, gate/up columns interleaved) to
    MoEExperts' (gate_up_proj [E, 2I, H] gate rows then up rows, down_proj [E, H, I])."""
    for name, tensor in weights:
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        part = match[2]
        if part == "down_proj_bias":
            yield name, tensor
            continue
        expected_dims = 2 if part.endswith("_bias") else 3
        if tensor.dim() != expected_dims:
            raise ValueError(
                f"weight {name}: expected a {expected_dims}-D stacked expert tensor, got {tuple(tensor.shape)}"
            )
        if part == "down_proj":  # [E, I, H] -> [E, H, I]
            yield name, tensor.transpose(1, 2)
            continue
        if part == "gate_up_proj":  # [E, H, 2I] -> [E, 2I, H]
            tensor = tensor.transpose(1, 2)
        # Interleaved columns (gate, up, gate, up, ...) -> gate rows, then up rows.
        yield name, torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)
