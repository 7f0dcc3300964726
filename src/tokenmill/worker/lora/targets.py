"""Which linear layers of a loaded model LoRA adapts, and how an adapter module maps onto them.

A LoRA module is named as the HF checkpoint names it (q_proj, gate_up_proj, ...); the model may
merge several into one layer (q/k/v into qkv_proj, gate/up into gate_up_proj). Each adapted layer
keeps one stacked A per part ([parts * R, in]) and one B ([out, R]) per device slot, so one
shrink and one expand serve the merged matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.lora.adapter_files import ATTENTION_MODULES, module_shapes
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)


@dataclass(frozen=True, slots=True)
class LayerGeometry:
    """One adapted linear layer: its merged parts' output rows on this rank (in order, tiling
    out_features), and, under tensor parallelism, which slice of the unsharded adapter it takes."""

    index: int  # position in the manager's list of layers
    layer: LinearBase
    part_starts: tuple[int, ...]  # this rank's rows
    part_rows: tuple[int, ...]
    shard_ids: tuple  # the layer's shard id of each part (None for a plain layer)
    # Tensor parallelism (one rank: the whole adapter). A column-parallel layer holds chunk
    # `part_chunks[p]` of part p's unsharded rows (chunks of part_rows[p]; a replicated KV head's
    # chunk is shared by several ranks): B's rows are cut the same way, A stays whole. A row-parallel
    # layer holds input columns [in_start, in_start + in_features): A's columns are cut, B stays
    # whole, and the layer's all-reduce sums the partial adapter products with the base ones.
    full_part_rows: tuple[int, ...] = ()  # each part's unsharded rows
    part_chunks: tuple[int, ...] = ()
    in_start: int = 0

    @property
    def num_parts(self) -> int:
        return len(self.part_rows)

    def part_b_rows(self, part: int, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows of part `part`'s unsharded B rows `rows`."""
        n = self.part_rows[part]
        return rows.narrow(0, self.part_chunks[part] * n, n)

    def a_columns(self, a: torch.Tensor) -> torch.Tensor:
        """This rank's input columns of an unsharded A [r, input_size]."""
        return a.narrow(1, self.in_start, self.layer.in_features)


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
        shard_ids = tuple(layer.shard_ids)
        # (first local row, local rows, this rank's chunk of the unsharded part) per part
        local = [layer.part_shard(shard_id) for shard_id in shard_ids]
        return LayerGeometry(
            index, layer, tuple(s for s, _, _ in local), tuple(n for _, n, _ in local), shard_ids,
            full_part_rows=tuple(layer.output_sizes), part_chunks=tuple(c for _, _, c in local),
        )  # fmt: skip
    if isinstance(layer, ColumnParallelLinear):
        chunk = layer.tp_rank
    elif isinstance(layer, RowParallelLinear | ReplicatedLinear) or layer.tp_size == 1:
        chunk = 0  # every output row (a family's own layers run on one rank)
    else:
        raise ValueError(f"LoRA cannot shard a {type(layer).__name__} for tensor parallelism")
    in_start = layer.tp_rank * layer.in_features if isinstance(layer, RowParallelLinear) else 0
    return LayerGeometry(
        index, layer, (0,), (layer.out_features,), (None,),
        full_part_rows=(layer.output_size,), part_chunks=(chunk,), in_start=in_start,
    )  # fmt: skip
