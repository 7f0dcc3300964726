"""LoRALinearMethod: the base layer's product, plus each token's adapter product x A^T B^T.

Wraps whatever method the layer has (16-bit, FP8, INT4, GGUF blocks): the base matmul runs
unchanged, then the adapters' shrink (x A^T, R columns per merged part) and expand (into each
part's output rows) add on top, segmented by the step's token -> slot mapping. A step where no
token has an adapter adds nothing.
"""

from __future__ import annotations

import torch

from tokenmill.model.layers.linear import LinearBase
from tokenmill.model.layers.linear_method import LinearMethod, WrappingLinearMethod
from tokenmill.worker.lora.step_mapping import LoRAStepMapping
from tokenmill.worker.lora.targets import LayerGeometry


class LoRALinearMethod(WrappingLinearMethod):
    def __init__(self, inner: LinearMethod, geometry: LayerGeometry, mapping: LoRAStepMapping, rank: int) -> None:
        super().__init__(inner)
        self.geometry = geometry
        self.mapping = mapping
        self.rank = rank

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        y = self.inner.apply(layer, x, bias, residual, out_dtype)
        if self.mapping.active:
            if self.mapping.use_kernels:
                self._add_with_kernels(layer, x, y)
            else:
                self._add_segments(layer, x, y)
        return y

    def _add_with_kernels(self, layer: LinearBase, x: torch.Tensor, y: torch.Tensor) -> None:
        from tokenmill.kernels.triton.lora import lora_apply

        m, g = self.mapping, self.geometry
        width = g.num_parts * self.rank
        shrunk = m.shrunk[: x.shape[0] * width].view(x.shape[0], width)
        lora_apply(
            x, y, layer.lora_a, layer.lora_b, m.sorted_token_ids, m.slot_starts, m.slot_counts,
            g.part_starts, g.part_rows, shrunk, m.scratch,
        )  # fmt: skip

    def _add_segments(self, layer: LinearBase, x: torch.Tensor, y: torch.Tensor) -> None:
        r, g = self.rank, self.geometry
        for slot, start, end in self.mapping.segments:
            shrunk = x[start:end].to(layer.lora_a.dtype) @ layer.lora_a[slot].T  # [n, parts * R]
            b = layer.lora_b[slot]
            for part, (first, rows) in enumerate(zip(g.part_starts, g.part_rows, strict=True)):
                delta = shrunk[:, part * r : (part + 1) * r] @ b[first : first + rows].T
                y[start:end, first : first + rows] += delta.to(y.dtype)
