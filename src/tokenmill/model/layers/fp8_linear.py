"""The FP8 W8A8 linear method: e4m3 weights with per-channel or 128x128-block scales.

Checkpoint layouts (model/loader/quant_config.py parses which): `weight` e4m3 [N, K] plus
`weight_scale` per tensor ([] / [1]; one per merged part), per channel ([N] / [N, 1]) or per
128x128 block ([N/128, K/128]; Hugging Face `fp8` names it `weight_scale_inv`), and with static
activation schemes an `input_scale` per tensor. Per-tensor scales become per-channel ones (each
part's scale over its rows), exactly. 16-bit weights quantized at load get per-channel scales (under tensor parallelism each rank
quantizes its shard; a row-parallel shard's scales take the whole row's absmax, so the ranks' FP8
values are the one-rank model's).

On the GPU the kernels (kernels/triton/fp8_linear.py) quantize activations dynamically, per token
(per 1x128 group for block weights); a checkpoint's static `input_scale` is read and checked but
not used, since a per-token scale is at least as accurate. Elsewhere the layer multiplies with the
dequantized weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from tokenmill.model.layers.linear import ParamLayout
from tokenmill.model.layers.quantize_weights import QuantizedFp8, dequantize_fp8, quantize_fp8_per_channel
from tokenmill.model.layers.quantized_method import (
    QuantizedLinearMethod,
    part_rows,
)

if TYPE_CHECKING:
    from tokenmill.config import KernelConfig
    from tokenmill.model.layers.linear import LinearBase
    from tokenmill.model.layers.linear_method import LinearMethod
    from tokenmill.model.loader.quant_config import QuantizationSpec


class Fp8LinearMethod(QuantizedLinearMethod):
    def __init__(
        self, spec: QuantizationSpec, base: LinearMethod, *, use_kernels: bool, kernel: KernelConfig | None = None
    ) -> None:
        super().__init__(spec, base, use_kernels=use_kernels, kernel=kernel)
        # At-load FP8 folds the deferred RMSNorm's weight before quantizing: e4m3 rounds relative to
        # each value, so quantize(W * w) is as accurate per element as quantize(W) (short of
        # subnormals). INT4 does not: its groups share one uniform grid, which the fold stretches to
        # the largest w * W of the group. On the default model's weights, folded vs not: FP8 mean
        # KL 0.016 vs 0.019, INT4 (awq) 0.79 vs 0.37 (benchmarks/norm_fold_quality.py).
        self.folds_input_scale = use_kernels and not spec.from_checkpoint
        self.dispatch = None  # fp8_linear's default thresholds
        if self.kernel.fp8_tensor_core_gemv:
            from tokenmill.kernels.triton.fp8_linear import Fp8Dispatch

            self.dispatch = Fp8Dispatch(tc16_min_rows=1)

    def create_checkpoint_params(
        self, layer: LinearBase, in_features: int, out_features: int, *, device, dtype: torch.dtype
    ) -> None:
        spec = self.spec
        layer.register_checkpoint_param(
            "weight", torch.empty((out_features, in_features), device=device, dtype=torch.float8_e4m3fn)
        )
        parts = len(part_rows(layer))
        f32 = {"device": device, "dtype": torch.float32}
        if spec.fp8_weight_strategy == "tensor":
            scale, layout = torch.empty((parts, 1), **f32), ParamLayout(per_part=True)
        elif spec.fp8_weight_strategy == "channel":
            scale, layout = torch.empty(out_features, **f32), ParamLayout(out_dim=0)
        else:
            assert spec.fp8_block is not None
            bn, bk = spec.fp8_block
            # Each merged part's blocks start at its first row (a part's last block may be partial).
            block_rows = sum(-(-rows // bn) for rows in part_rows(layer))
            scale = torch.empty((block_rows, -(-in_features // bk)), **f32)
            layout = ParamLayout(out_dim=0, out_per_index=bn, round_up_per_part=True, in_dim=1, in_per_index=bk)
        layer.register_checkpoint_param(spec.fp8_scale_name, scale, layout)
        if spec.fp8_static_input_scales:
            layer.register_checkpoint_param("input_scale", torch.empty((parts, 1), **f32), ParamLayout(per_part=True))

    def quantized_form(self, layer: LinearBase) -> QuantizedFp8:
        """weight e4m3 [N, K] with float32 scales per channel [N] or per block."""
        spec = self.spec
        if not spec.from_checkpoint:
            return quantize_fp8_per_channel(layer.weight.data, _whole_row_absmax(layer))
        scale = getattr(layer, spec.fp8_scale_name).data
        if spec.fp8_static_input_scales:
            _check_input_scales(layer.input_scale.data)
        if spec.fp8_weight_strategy == "tensor":  # one scale per merged part -> per channel, exactly
            rows = torch.tensor(part_rows(layer), device=scale.device)
            scale = scale.reshape(-1).repeat_interleave(rows)
        block = spec.fp8_block if spec.fp8_weight_strategy == "block" else None
        if block is not None and not _blocks_aligned(layer, block[0]):
            # Parts whose blocks do not tile the merged weight: keep each part's (weight, scales).
            return _PartwiseBlocks(_split_parts(layer, layer.weight.data, scale, block[0]), block)
        return QuantizedFp8(layer.weight.data, scale.contiguous(), block)

    def dequantize(self, form) -> torch.Tensor:
        if isinstance(form, _PartwiseBlocks):
            return torch.cat([dequantize_fp8(w, s, form.block) for w, s in form.parts])
        return dequantize_fp8(*form)

    def prepare_for_kernels(self, form):
        from tokenmill.kernels.triton.fp8_linear import prepare_fp8_weights

        if isinstance(form, _PartwiseBlocks):
            raise ValueError(
                f"block-scaled FP8 on the GPU needs each merged part (q/k/v, gate/up) to be a multiple of "
                f"{form.block[0]} rows; this layer's parts are not"
            )
        return prepare_fp8_weights(*form)

    def apply_kernels(self, kernel_weights, x, bias, residual, out_dtype) -> torch.Tensor:
        from tokenmill.kernels.triton.fp8_linear import fp8_linear

        return fp8_linear(x, kernel_weights, bias, residual, out_dtype, dispatch=self.dispatch)


def _whole_row_absmax(layer: LinearBase) -> torch.Tensor | None:
    """A layer holding a tensor-parallel slice of its input columns (row-parallel): each output row's
    absmax over every rank's columns, so that each rank's scales, and so its FP8 values, are those
    of the whole weight quantized at once; None for a layer holding whole rows (column-parallel:
    its rows' scales are its own). Every rank processes its layers in the same order, so this
    collective lines up."""
    if layer.in_features == layer.input_size:
        return None
    from tokenmill.distributed.parallel_state import all_reduce_max

    return all_reduce_max(layer.weight.data.abs().amax(dim=1).float())


class _PartwiseBlocks(NamedTuple):
    parts: list[tuple[torch.Tensor, torch.Tensor]]  # (weight rows, their block scales) per merged part
    block: tuple[int, int]


def _blocks_aligned(layer: LinearBase, block_rows: int) -> bool:
    return all(rows % block_rows == 0 for rows in part_rows(layer)[:-1])


def _split_parts(layer: LinearBase, weight: torch.Tensor, scale: torch.Tensor, block_rows: int):
    rows = part_rows(layer)
    scale_rows = [-(-r // block_rows) for r in rows]
    return list(zip(weight.split(rows), scale.split(scale_rows), strict=True))


def _check_input_scales(scales: torch.Tensor) -> None:
    if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
        raise ValueError(f"input_scale holds {scales.flatten().tolist()}: static activation scales must be positive")
