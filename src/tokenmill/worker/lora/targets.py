"""Which linear layers of a loaded model LoRA adapts, and how an adapter module maps onto them.

A LoRA module is named as the HF checkpoint names it (q_proj, gate_up_proj, ...); the model may
merge several into one layer (q/k/v into qkv_proj, gate/up into gate_up_proj). Each adapted layer
keeps one stacked A per part ([parts * R, in]) and one B ([out, R]) per device slot, so one
shrink and one expand serve the merged matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from tokenmill.lora.adapter_files import ATTENTION_MODULES, module_shapes
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.linear import LinearBase, MergedColumnParallelLinear


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    """One adapted linear layer: its merged parts' output rows (in order, tiling out_features)."""

    index: int  # position in the manager's list of layers
    layer: LinearBase
    part_starts: tuple[int, ...]
    part_rows: tuple[int, ...]
    shard_ids: tuple  # the layer's shard id of each part (None for a plain layer)

    @property
    def num_parts(self) -> int:
        return len(self.part_rows)


@dataclass(frozen=True, slots=True)
class ModuleTarget:
    """Where an adapter module of one decoder layer goes: the layer and the parts it feeds (all of
    them for a fused module such as Phi-3's qkv_proj)."""

    geometry: LayerGeometry
    parts: tuple[int, ...]


def find_targets(model: nn.Module, arch: ArchConfig) -> tuple[list[LayerGeometry], dict[tuple[int, str], ModuleTarget]]:
    """The model's adaptable layers and, per (decoder layer, HF module name), where it goes."""
    linear_for_weight = getattr(model, "linear_for_weight", None)
    if linear_for_weight is None:
        raise ValueError(f"LoRA is not supported for {type(model).__name__} models")
    geometries: dict[int, LayerGeometry] = {}
    targets: dict[tuple[int, str], ModuleTarget] = {}
    modules = module_shapes(arch)
    for i in range(arch.num_layers):
        for module in modules:
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            try:  # a family names only one of q_proj / qkv_proj (gate_proj / gate_up_proj)
                found = linear_for_weight(f"model.layers.{i}.{block}.{module}.weight")
            except ValueError:
                found = None
            if found is None:
                continue
            layer, shard_id = found
            if layer.tp_size != 1:
                raise ValueError("LoRA with tensor parallelism is not supported yet")
            geometry = geometries.get(id(layer))
            if geometry is None:
                geometry = geometries[id(layer)] = _geometry(len(geometries), layer)
            if shard_id is None:
                parts = tuple(range(geometry.num_parts))
            else:
                parts = (geometry.shard_ids.index(shard_id),)
            targets[(i, module)] = ModuleTarget(geometry, parts)
    return list(geometries.values()), targets


def _geometry(index: int, layer: LinearBase) -> LayerGeometry:
    if isinstance(layer, MergedColumnParallelLinear):
        rows = tuple(layer.output_sizes)
        starts = tuple(sum(rows[:p]) for p in range(len(rows)))
        return LayerGeometry(index, layer, starts, rows, tuple(layer.shard_ids))
    return LayerGeometry(index, layer, (0,), (layer.out_features,), (None,))
