"""The INT4 weight-only (W4A16) linear method: AWQ, GPTQ and compressed-tensors `pack-quantized`
checkpoints, or 16-bit weights rounded to 4-bit groups at load.

Checkpoint layouts (K = in features, N = out, G = groups along K):
- AWQ ("gemm"): `qweight` int32 [K, N/8] and `qzeros` int32 [G, N/8] (8 nibbles per word, AWQ's
  interleaved order), `scales` [G, N];
- GPTQ: `qweight` int32 [K/8, N] (packed along K), `qzeros` int32 [G, N/8], `scales` [G, N],
  `g_idx` int32 [K] (act-order checkpoints permute the groups);
- compressed-tensors `pack-quantized`: `weight_packed` int32 [N, K/8] (packed along K),
  `weight_scale` [N, G], `weight_shape` [2] (the whole layer's [N, K], one per merged part), with
  zero points `weight_zero_point` int32 [N/8, G] (packed along N), with actorder "group"
  `weight_g_idx` int32 [K].
All unpack (model/loader/int4_checkpoint.py) to one canonical form: q [N, K] values 0..15, scales
and zeros [N, G], g_idx [K]; W[n, k] = (q[n, k] - zeros[n, g]) * scales[n, g], g = g_idx[k]. On the
GPU that form is repacked for the Triton kernels (kernels/triton/int4_linear.py); elsewhere the
layer multiplies with the dequantized weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tokenmill.model.layers.linear import ParamLayout
from tokenmill.model.layers.quantize_weights import QuantizedInt4, dequantize_int4, quantize_int4
from tokenmill.model.layers.quantized_method import QuantizedLinearMethod, part_rows
from tokenmill.model.loader.int4_checkpoint import unpack_awq, unpack_gptq, unpack_pack_quantized

if TYPE_CHECKING:
    from tokenmill.model.layers.linear import LinearBase

PACK = 8  # 4-bit values per int32 word


class Int4LinearMethod(QuantizedLinearMethod):
    def group_size_for(self, in_features: int) -> int:
        return in_features if self.spec.group_size == -1 else self.spec.group_size

    def create_checkpoint_params(
        self, layer: LinearBase, in_features: int, out_features: int, *, device, dtype: torch.dtype
    ) -> None:
        spec = self.spec
        group = self.group_size_for(in_features)
        # AWQ's qweight, AWQ / GPTQ qzeros and compressed-tensors' zero points pack output rows.
        packs_rows = spec.int4_format != "pack-quantized" or spec.zero_point
        if in_features % group or in_features % PACK or (packs_rows and out_features % PACK):
            raise ValueError(
                f"a {out_features}x{in_features} layer cannot hold {spec.method} 4-bit weights in groups of "
                f"{group}: the input size must be a multiple of the group size and of {PACK}"
                + (f", and the output size of {PACK}" if packs_rows else "")
            )
        groups = in_features // group
        i32 = {"device": device, "dtype": torch.int32}
        if spec.int4_format == "pack-quantized":
            self._create_pack_quantized_params(layer, in_features, out_features, group, groups, i32)
            return
        # Input-dimension entries (a row-parallel shard's columns): one per column, per 8 packed
        # columns (GPTQ's qweight), per group (zeros, scales).
        # (Per-channel zeros / scales, group_size -1, hold whole rows: every shard takes them whole.)
        group_dim = None if spec.group_size == -1 else 0
        packed_out_per_group = ParamLayout(out_dim=1, out_per_index=PACK, in_dim=group_dim, in_per_index=group)
        if spec.int4_format == "awq":
            layer.register_checkpoint_param(
                "qweight", torch.empty((in_features, out_features // PACK), **i32),
                ParamLayout(out_dim=1, out_per_index=PACK, in_dim=0),
            )  # fmt: skip
        else:
            layer.register_checkpoint_param(
                "qweight", torch.empty((in_features // PACK, out_features), **i32),
                ParamLayout(out_dim=1, in_dim=0, in_per_index=PACK),
            )  # fmt: skip
        layer.register_checkpoint_param("qzeros", torch.empty((groups, out_features // PACK), **i32), packed_out_per_group)
        layer.register_checkpoint_param(
            "scales", torch.empty((groups, out_features), device=device, dtype=torch.float32),
            ParamLayout(out_dim=1, in_dim=group_dim, in_per_index=group),
        )  # fmt: skip
        if spec.int4_format == "gptq":
            self._create_g_idx(layer, "g_idx", in_features, group, i32)

    def _create_pack_quantized_params(
        self, layer: LinearBase, in_features: int, out_features: int, group: int, groups: int, i32: dict
    ) -> None:
        """compressed-tensors' tensors are laid out [N, ...] (output rows first), unlike AWQ / GPTQ:
        input-dimension entries (a row-parallel shard's) are along dim 1, one per 8 packed columns
        (weight_packed) or per group (scales, zero points; per-channel ones are whole on every shard)."""
        spec = self.spec
        group_dim = None if spec.group_size == -1 else 1
        layer.register_checkpoint_param(
            "weight_packed", torch.empty((out_features, in_features // PACK), **i32),
            ParamLayout(out_dim=0, in_dim=1, in_per_index=PACK),
        )  # fmt: skip
        layer.register_checkpoint_param(
            "weight_scale", torch.empty((out_features, groups), device=i32["device"], dtype=torch.float32),
            ParamLayout(out_dim=0, in_dim=group_dim, in_per_index=group),
        )  # fmt: skip
        if spec.zero_point:
            layer.register_checkpoint_param(
                "weight_zero_point", torch.empty((out_features // PACK, groups), **i32),
                ParamLayout(out_dim=0, out_per_index=PACK, in_dim=group_dim, in_per_index=group),
            )  # fmt: skip
        # The whole (unsharded) [N, K] of each merged part, checked as it loads (load_weight).
        parts = len(part_rows(layer))
        layer.register_checkpoint_param(
            "weight_shape", torch.empty((parts, 2), device=i32["device"], dtype=torch.int64),
            ParamLayout(per_part=True),
        )  # fmt: skip
        if spec.act_order:  # actorder "group"; without it a checkpoint holds no g_idx
            self._create_g_idx(layer, "weight_g_idx", in_features, group, i32)

    def _create_g_idx(self, layer: LinearBase, name: str, in_features: int, group: int, i32: dict) -> None:
        # One g_idx per merged part (their inputs are one, so they must agree: checked after loading).
        parts = len(part_rows(layer))
        layer.register_checkpoint_param(
            name, torch.empty((parts, in_features), **i32), ParamLayout(per_part=True, in_dim=0),
            required=self.spec.act_order,
        )  # fmt: skip
        if not self.spec.act_order:  # checkpoints without act-order may omit it: groups in order
            getattr(layer, name).data.copy_(torch.arange(in_features, device=i32["device"], dtype=torch.int32) // group)

    def load_weight(self, layer: LinearBase, target: torch.Tensor, loaded: torch.Tensor) -> None:
        shapes = getattr(layer, "weight_shape", None) if self.spec.int4_format == "pack-quantized" else None
        # weight_shape is the one tensor whose values, not only its shape, must agree with the model
        # config; checked here, while the loader still knows the tensor's name to put in the error.
        if shapes is not None and target.untyped_storage().data_ptr() == shapes.untyped_storage().data_ptr():
            part = target.storage_offset() // shapes.stride(0)
            rows = getattr(layer, "output_sizes", (layer.output_size,))[part]
            expected = [rows, layer.input_size]
            fused = [layer.output_size, layer.input_size]  # a fused checkpoint tensor's (Phi-3's qkv_proj)
            if loaded.reshape(-1).tolist() not in (expected, fused):
                raise ValueError(
                    f"weight_shape holds {loaded.reshape(-1).tolist()}, but the model config makes this layer "
                    f"{expected} ([out_features, in_features]): the checkpoint disagrees with config.json"
                )
        super().load_weight(layer, target, loaded)

    def quantized_form(self, layer: LinearBase) -> QuantizedInt4:
        spec = self.spec
        group = self.group_size_for(layer.in_features)
        if not spec.from_checkpoint:
            return quantize_int4(layer.weight.data, group, symmetric=not spec.zero_point, scale_dtype=torch.float32)
        if spec.int4_format == "awq":
            return unpack_awq(layer.qweight.data, layer.qzeros.data, layer.scales.data, group)
        if spec.int4_format == "pack-quantized":
            zeros = layer.weight_zero_point.data if spec.zero_point else None
            g_idx = _shared_g_idx(layer, layer.weight_g_idx.data) if spec.act_order else None
            return unpack_pack_quantized(layer.weight_packed.data, layer.weight_scale.data, zeros, g_idx, group)
        return unpack_gptq(
            layer.qweight.data, layer.qzeros.data, layer.scales.data, _shared_g_idx(layer, layer.g_idx.data), group,
            sym=not spec.zero_point, zeros_offset=spec.gptq_zeros_offset,
        )  # fmt: skip

    def dequantize(self, form: QuantizedInt4) -> torch.Tensor:
        return dequantize_int4(form.q, form.scales, form.zeros, form.group_size, form.g_idx)

    def prepare_for_kernels(self, form: QuantizedInt4):
        from tokenmill.kernels.triton.int4_linear import prepare_int4_weights

        return prepare_int4_weights(form.q, form.scales.to(self.dtype), form.zeros, form.group_size, form.g_idx)

    def apply_kernels(self, kernel_weights, x, bias, residual, out_dtype) -> torch.Tensor:
        from tokenmill.kernels.triton.int4_linear import int4_linear

        return int4_linear(
            x, kernel_weights, bias, residual, out_dtype, zero_by_xsum=self.kernel.int4_zero_by_xsum
        )


def _shared_g_idx(layer: LinearBase, g_idx_parts: torch.Tensor) -> torch.Tensor:
    """The one g_idx [K] of a layer's merged parts ([parts, K], which must agree), numbered from this
    rank's first group."""
    if not bool((g_idx_parts == g_idx_parts[:1]).all()):
        raise ValueError(
            "g_idx differs between the merged parts of one layer (q/k/v or gate/up), which share their "
            "input; tokenmill needs them equal"
        )
    g_idx = g_idx_parts[0]
    if layer.in_features != layer.input_size:
        # A row-parallel shard's columns: groups in order (act-order is refused under tensor
        # parallelism), numbered from this shard's first group, as its zeros / scales are.
        g_idx = g_idx - g_idx.min()
    return g_idx
