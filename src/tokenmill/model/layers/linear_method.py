"""The linear-method seam: how one linear layer's weights are created, loaded, prepared and multiplied.

A linear module (layers/linear.py) owns its parameters and its shard geometry; its `method` owns
the weight format. One method is chosen at load (layers/linear_select.py) from the device, dtype,
weight format and KernelConfig. Every piece of format state lives on the layer (as a module
attribute) or on the method object, never as an attribute stuck on a tensor.

A method that changes how a layer multiplies without changing its weights (a LoRA adapter, a
call counter, the GGUF blocks beside float weights) subclasses `WrappingLinearMethod` and is
put in place with `wrap_linear_methods`; one that changes the weights (FP8, INT4) subclasses
`LinearMethod` and is returned by `select_linear_method`. Model files never name a method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tokenmill.model.layers.linear import LinearBase


class LinearMethod:
    """16-bit or float32 weights [out, in] multiplied with F.linear: the CPU's plain path, and the
    base every other method starts from. Methods may be shared by many layers: per-layer state
    goes on the layer."""

    # Whether apply(residual=...) adds the residual inside the matmul's launch (an epilogue), so a
    # model may hand it the residual stream instead of adding the output itself.
    residual_in_epilogue: bool = False
    # Whether this method's weights may absorb a per-input-column scale (W <- W * w), which the
    # deferred RMSNorm needs (layers/linear.py LinearBase.fold_input_scale).
    folds_input_scale: bool = False

    def create_weights(
        self, layer: LinearBase, in_features: int, out_features: int, *, device, dtype: torch.dtype
    ) -> None:
        """Register this layer's (local shard's) weight parameter(s), uninitialized."""
        layer.weight = nn.Parameter(
            torch.empty((out_features, in_features), device=device, dtype=dtype), requires_grad=False
        )

    def load_weight(self, layer: LinearBase, target: torch.Tensor, loaded: torch.Tensor) -> None:
        """Copy (a shard of) a checkpoint tensor into the slice of a parameter the layer picked;
        converts dtype and device."""
        target.copy_(loaded)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        """Put a loaded layer's weights in the form apply() reads."""

    def process_layers_after_loading(self, layers: Sequence[LinearBase]) -> None:
        """Every layer this method serves, once the model is loaded (a method-wide decision, such as
        a memory budget, goes here)."""
        for layer in layers:
            self.process_weights_after_loading(layer)

    def fold_input_scale(self, layer: LinearBase, scale: torch.Tensor) -> None:
        """W <- W * scale along the input dimension, rounded once: the layer now multiplies x * scale
        where it multiplied x. Only called where `folds_input_scale`."""
        with torch.no_grad():
            layer.weight.mul_(scale)

    def release_single_row_copy(self, layer: LinearBase) -> None:
        """Free a second copy of the weights kept only for one-row products (another method serves
        those now). Nothing to free here."""

    def release_float_copies(self, layer: LinearBase) -> None:
        """Free the float weights this method multiplies with: another method serves every
        product of the layer now. Nothing here (the plain weight is the layer's parameter)."""

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """`x @ W.T + bias`, converted to `out_dtype`; with `residual`, `residual + that` (in place
        in `residual` where the method can, and returned)."""
        return finish_product(F.linear(x, layer.weight, bias), residual, out_dtype)


def finish_product(
    y: torch.Tensor, residual: torch.Tensor | None, out_dtype: torch.dtype | None
) -> torch.Tensor:
    """What `apply` returns for a product `y` computed without an epilogue: `residual + y` in place
    in `residual`, else `y` converted to `out_dtype`."""
    if residual is not None:
        return residual.add_(y)
    return y if out_dtype is None else y.to(out_dtype)


class WrappingLinearMethod(LinearMethod):
    """A method around another: everything goes to `inner` unless a subclass overrides it. Wrap a
    loaded model's layers with `wrap_linear_methods`; their weights are already processed."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.residual_in_epilogue = inner.residual_in_epilogue
        self.folds_input_scale = inner.folds_input_scale

    def create_weights(
        self, layer: LinearBase, in_features: int, out_features: int, *, device, dtype: torch.dtype
    ) -> None:
        self.inner.create_weights(layer, in_features, out_features, device=device, dtype=dtype)

    def load_weight(self, layer: LinearBase, target: torch.Tensor, loaded: torch.Tensor) -> None:
        self.inner.load_weight(layer, target, loaded)

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        self.inner.process_weights_after_loading(layer)

    def process_layers_after_loading(self, layers: Sequence[LinearBase]) -> None:
        self.inner.process_layers_after_loading(layers)

    def fold_input_scale(self, layer: LinearBase, scale: torch.Tensor) -> None:
        self.inner.fold_input_scale(layer, scale)

    def release_single_row_copy(self, layer: LinearBase) -> None:
        self.inner.release_single_row_copy(layer)

    def release_float_copies(self, layer: LinearBase) -> None:
        self.inner.release_float_copies(layer)

    def apply(
        self,
        layer: LinearBase,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        return self.inner.apply(layer, x, bias, residual, out_dtype)
