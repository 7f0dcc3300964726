"""What the FP8 and INT4 linear methods share: loading a quantized checkpoint's tensors (or 16-bit
weights to quantize at load), then either kernel-ready tensors on the GPU or, everywhere else, the
dequantized float weight handed to the 16-bit method (the CPU's reference path: the product of the
dequantized weights, which is what the tests compare with transformers on).

A subclass names its checkpoint tensors (`create_checkpoint_params`), turns what was loaded into its
canonical quantized form (`quantized_form`), and says how the GPU kernels take and multiply it
(`prepare_for_kernels`, `apply_kernels`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tokenmill.config import KernelConfig
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.loader.quant_config import QuantizationSpec

if TYPE_CHECKING:
    from tokenmill.model.layers.linear import LinearBase


class QuantizedLinearMethod(LinearMethod):
    def __init__(
        self,
        spec: QuantizationSpec,
        base: LinearMethod,
        *,
        use_kernels: bool,
        kernel: KernelConfig | None = None,  # the kernel-path choices a subclass reads (its GPU variants)
    ) -> None:
        self.spec = spec
        self.kernel = kernel or KernelConfig()
        self.base = base  # the 16-bit method: excluded layers (lm_head, ignore), and the CPU's products
        self.use_kernels = use_kernels
        self.residual_in_epilogue = use_kernels
        self.dtype = torch.float32  # the model's, set by create_weights
        # The deferred RMSNorm's fold (W <- W * norm weight), where a subclass allows it: weights
        # quantized at load take it into their 16-bit form before they are quantized
        # (registry.load_model folds first), so the kernels multiply the folded weight and decode
        # steps skip the norm launches as 16-bit models do. A quantized checkpoint's weights would
        # need a requantization (an extra rounding): not done. Multiplying x by the norm weight
        # inside the kernels instead cost the FP8 GEMVs more than the launches
        # (benchmarks/BENCHMARKS.md, issue 16 on the H200).
        self.folds_input_scale = False

    def fold_input_scale(self, layer: LinearBase, scale: torch.Tensor) -> None:
        if getattr(layer, "quantized_weights", None) is not None or self.spec.from_checkpoint:
            raise ValueError(
                f"{type(self).__name__} folds a norm weight into 16-bit weights before it quantizes them "
                "at load (fold_norm_weights before process_weights_after_loading), not into quantized ones"
            )
        LinearMethod.fold_input_scale(self, layer, scale)

    # -- subclass hooks -------------------------------------------------------------------------------

    def create_checkpoint_params(
        self, layer: LinearBase, in_features: int, out_features: int, *, device, dtype: torch.dtype
    ) -> None:
        raise NotImplementedError

    def quantized_form(self, layer: LinearBase) -> Any:
        """The loaded layer's weights in the method's canonical quantized form (from the checkpoint's
        tensors, or quantizing the loaded 16-bit weight)."""
        raise NotImplementedError

    def dequantize(self, form: Any) -> torch.Tensor:
        raise NotImplementedError

    def prepare_for_kernels(self, form: Any) -> Any:
        raise NotImplementedError

    def apply_kernels(
        self, kernel_weights: Any, x: torch.Tensor, bias, residual, out_dtype
    ) -> torch.Tensor:
        raise NotImplementedError

    # -- LinearMethod ---------------------------------------------------------------------------------

    def create_weights(
        self, layer: LinearBase, in_features: int, out_features: int, *, device, dtype: torch.dtype
    ) -> None:
        self.dtype = dtype
        if self.spec.from_checkpoint:
            layer.checkpoint_params = ()
            self.create_checkpoint_params(layer, in_features, out_features, device=device, dtype=dtype)
        else:
            self.base.create_weights(layer, in_features, out_features, device=device, dtype=dtype)

    def process_layers_after_loading(self, layers: Sequence[LinearBase]) -> None:
        for layer in layers:
            form = self.quantized_form(layer)
            layer.forget_checkpoint_params()
            if self.use_kernels:
                layer.quantized_weights = self.prepare_for_kernels(form)
            else:
                weight = self.dequantize(form).to(self.dtype)
                layer.weight = nn.Parameter(weight, requires_grad=False)
                layer.checkpoint_params = ("weight",)
            del form
        if not self.use_kernels:
            self.base.process_layers_after_loading(layers)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.process_layers_after_loading([layer])

    def release_single_row_copy(self, layer: LinearBase) -> None:
        if not self.use_kernels:
            self.base.release_single_row_copy(layer)

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        if self.use_kernels:
            return self.apply_kernels(layer.quantized_weights, x, bias, residual, out_dtype)
        return self.base.apply(layer, x, bias, residual, out_dtype)


def kernel_weight_bytes(model: nn.Module) -> int:
    """Bytes of the kernel-ready quantized weights of `model`'s linear layers (which are module
    attributes, not parameters): what a decode step reads of them."""
    from tokenmill.model.layers.linear import linear_layers

    total = 0
    for layer in linear_layers(model):
        prepared = getattr(layer, "quantized_weights", None)
        if prepared is None:
            continue
        tensors = (getattr(prepared, field.name) for field in dataclasses.fields(prepared))
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def part_rows(layer: LinearBase) -> list[int]:
    """This rank's output rows of each merged part of `layer` ([out_features] for a plain layer);
    callable from create_weights too, before a merged layer has its shard ids."""
    shard_ids = getattr(layer, "shard_ids", None)
    if shard_ids is not None:
        return [layer._part_rows(shard_id)[1] for shard_id in shard_ids]
    sizes = getattr(layer, "output_sizes", None)
    return [layer.out_features] if sizes is None else [size // layer.tp_size for size in sizes]
