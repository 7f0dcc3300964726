"""An adapter's weights in host memory, laid out as the device slots hold them.

Per adapted layer: A stacked over the layer's merged parts, [parts * R, in] (part p's rows p*R ..
p*R + r, the rest zero), and B [out, R] with the scale folded in (columns r.. zero). A layer the
adapter does not touch has no entry; its slot is zeroed. Built on the loader thread (file reads,
no device work), so a load never holds up the step loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.lora.adapter_files import AdapterSpec, read_adapter
from tokenmill.lora.request import LoRARequest
from tokenmill.model.arch import ArchConfig
from tokenmill.worker.lora.targets import LayerGeometry, ModuleTarget


@dataclass(slots=True)
class HostAdapter:
    lora: LoRARequest
    rank: int
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]  # geometry index -> (A, B)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.layers.values())


def load_host_adapter(
    lora: LoRARequest,
    model: nn.Module,
    arch: ArchConfig,
    targets: dict[tuple[int, str], ModuleTarget],
    max_rank: int,
    dtype: torch.dtype,
    pin: bool,
) -> HostAdapter:
    """Read and lay out the adapter at lora.lora_path; ValueError (AdapterError) naming the problem."""
    from safetensors.torch import load_file

    spec: AdapterSpec = read_adapter(lora.lora_path, arch, max_rank)
    tensors = load_file(str(spec.weights_file))
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    geometries: dict[int, LayerGeometry] = {}
    for module in spec.modules:
        target = targets.get((module.layer, module.module))
        if target is None:
            raise ValueError(f"the adapter adapts layer {module.layer} {module.module}, which this model has no layer for")
        geometry = target.geometry
        if geometry.index not in layers:
            layer = geometry.layer
            a = torch.zeros(geometry.num_parts * max_rank, layer.in_features, dtype=torch.float32)
            b = torch.zeros(layer.out_features, max_rank, dtype=torch.float32)
            layers[geometry.index] = (a, b)
            geometries[geometry.index] = geometry
        a, b = layers[geometry.index]
        lora_a = geometry.a_columns(tensors[module.a_name].float())  # this rank's input columns
        lora_b = tensors[module.b_name].float() * module.scale
        fused = len(target.parts) > 1  # a fused module (Phi-3's qkv_proj): its B rows split over the parts
        for part in target.parts:
            start, rows = geometry.part_starts[part], geometry.part_rows[part]
            a[part * max_rank : part * max_rank + module.rank] = lora_a
            if fused:
                full_start = sum(geometry.full_part_rows[:part])
                part_b = lora_b[full_start : full_start + geometry.full_part_rows[part]]
            else:
                part_b = lora_b
            # Permuted as the model permuted the whole part's rows, then this rank's rows of it.
            part_b = geometry.part_b_rows(part, _rows_in_model_layout(model, geometry, part, part_b))
            b[start : start + rows, : module.rank] = part_b
    for index, (a, b) in layers.items():
        a = _fold_input_scale(geometries[index], a)
        layers[index] = (_host(a, dtype, pin), _host(b, dtype, pin))
    return HostAdapter(lora, spec.rank, layers)


def _rows_in_model_layout(model: nn.Module, geometry: LayerGeometry, part: int, rows: torch.Tensor) -> torch.Tensor:
    """B's rows permuted as the model permuted the base weight's (partial rotary's q/k rows)."""
    layout = getattr(model, "rows_in_model_layout", None)
    return rows if layout is None else layout(rows, geometry.shard_ids[part])


def _fold_input_scale(geometry: LayerGeometry, a: torch.Tensor) -> torch.Tensor:
    """A deferred RMSNorm folded its weight into the layer's input columns, so the layer's input
    lacks it: A takes it too."""
    scale = getattr(geometry.layer, "folded_input_scale", None)
    return a if scale is None else a * scale.detach().to("cpu", torch.float32)


def _host(tensor: torch.Tensor, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    tensor = tensor.to(dtype).contiguous()
    return tensor.pin_memory() if pin else tensor
