"""4-bit (W4A16) routed-expert weights for the MoE blocks (layers/moe.py MoEExperts): the experts'
counterpart of the INT4 linear method (layers/int4_linear.py), chosen with it.

Checkpoints store one set of tensors per expert and projection, in the layouts the dense layers
read (model/loader/int4_checkpoint.py): AWQ (`qweight`, `qzeros`, `scales`), GPTQ (the same plus
`g_idx`) and compressed-tensors `pack-quantized` (`weight_packed`, `weight_scale`, `weight_shape`,
`weight_zero_point` when asymmetric). They are kept as loaded until every expert has arrived, then
each is unpacked to the canonical form (q [N, K] 0..15, scales and zeros [N, G]) and stacked:

- GPU: repacked for the fused MoE kernels (kernels/triton/fused_moe.py, W4A16): q int32
  [E, N, K/8] in kernels/triton/moe_int4_layout.py's packs, float32 scales [E, N, G], zeros uint8
  [E, N, G]; about a quarter of bf16's bytes.
- Elsewhere: the dequantized float weights (the CPU's reference path, which the tests compare with
  transformers on).

`--quantization awq | gptq` on a 16-bit MoE checkpoint rounds each expert's rows to 4-bit groups of
128 at load, as for the dense layers. Act-order (a permuted g_idx) is refused for experts: the
kernels read groups in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.kernels.triton.moe_int4_layout import pack_int4_experts
from tokenmill.model.layers.quantize_weights import QuantizedInt4, dequantize_int4, quantize_int4
from tokenmill.model.loader.int4_checkpoint import unpack_awq, unpack_gptq, unpack_pack_quantized
from tokenmill.model.loader.quant_config import QuantizationSpec

if TYPE_CHECKING:
    from tokenmill.model.layers.moe import ExpertShard, MoEExperts

# The tensors of one quantized projection, per checkpoint format (besides the optional ones).
_REQUIRED_LEAVES = {
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales"),
    "pack-quantized": ("weight_packed", "weight_scale", "weight_shape"),
}
_OPTIONAL_LEAVES = {"awq": (), "gptq": ("g_idx",), "pack-quantized": ("weight_zero_point", "weight_g_idx")}


@dataclass(frozen=True, slots=True)
class Int4ExpertScales:
    """What the W4A16 kernels take beside the packed weights."""

    w13_scale: torch.Tensor  # float32 [E, 2I, H/G]
    w13_zeros: torch.Tensor  # uint8 [E, 2I, H/G]
    w2_scale: torch.Tensor  # [E, H, I/G]
    w2_zeros: torch.Tensor  # uint8 [E, H, I/G]
    group_size: int | None  # None: one group per row

    def kernel_kwargs(self) -> dict:
        return {
            "w13_scale": self.w13_scale, "w13_zeros": self.w13_zeros, "w2_scale": self.w2_scale,
            "w2_zeros": self.w2_zeros, "group_size": self.group_size,
        }  # fmt: skip


class Int4ExpertWeights:
    """Collects, unpacks and finishes 4-bit expert weights on a MoEExperts (`experts.quant`)."""

    def __init__(self, spec: QuantizationSpec, *, use_kernels: bool) -> None:
        if spec.scheme != "int4_w4a16":
            raise ValueError(f"{spec.describe()}: not a 4-bit scheme")
        if spec.act_order:
            raise ValueError(
                f"{spec.describe()}: act-order (a permuted g_idx) is not supported for mixture-of-experts "
                "experts; use a checkpoint quantized without desc_act / actorder group"
            )
        self.spec = spec
        self.use_kernels = use_kernels
        self.format = spec.int4_format if spec.from_checkpoint else None

    # -- creation and loading -----------------------------------------------------------------------

    def create_weights(self, experts: MoEExperts, *, device, dtype: torch.dtype) -> None:
        """A checkpoint's packed tensors are kept as they load (`pending`); the 16-bit stacks go."""
        experts.int4_pending = {}
        if self.format is None:
            return  # 16-bit weights quantized after loading
        for name in ("gate_up_proj", "down_proj"):
            setattr(experts, name, nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False))

    def checkpoint_leaves(self) -> tuple[str, ...]:
        """The tensors every quantized expert projection must have in the checkpoint."""
        if self.format is None:
            return ()
        leaves = _REQUIRED_LEAVES[self.format]
        if self.format == "pack-quantized" and self.spec.zero_point:
            leaves += ("weight_zero_point",)
        return leaves

    def accepted_leaves(self) -> tuple[str, ...]:
        return () if self.format is None else _REQUIRED_LEAVES[self.format] + _OPTIONAL_LEAVES[self.format]

    def load_leaf(self, experts: MoEExperts, projection: str, leaf: str, loaded: torch.Tensor,
                  shard_id: ExpertShard) -> None:  # fmt: skip
        """Keep one expert projection's tensor until process_after_loading; projection gate_up_proj
        (shard (e, 0 | 1)) or down_proj (shard (e, None))."""
        if self.format is None or leaf not in self.accepted_leaves():
            raise ValueError(f"no such {leaf}: these experts take {', '.join(self.accepted_leaves()) or 'weight'}")
        if shard_id is None:
            raise ValueError(f"stacked {projection} tensors are not read; this loader takes one tensor per expert")
        expert, part = shard_id
        if not 0 <= expert < experts.num_experts:
            raise ValueError(f"expert {expert} is outside this layer's {experts.num_experts} experts")
        if experts.tp_size > 1:
            raise ValueError("4-bit expert weights are not sharded for tensor parallelism yet")
        experts.int4_pending[projection, expert, part or 0, leaf] = loaded

    # -- after loading ------------------------------------------------------------------------------

    def process_after_loading(self, experts: MoEExperts, dtype: torch.dtype) -> None:
        if self.format is None:
            w13 = self._quantize(experts.gate_up_proj.data)
            w2 = self._quantize(experts.down_proj.data)
        else:
            inter, hidden = experts.intermediate_size, experts.hidden_size
            w13 = [self._unpack_stack(experts, "gate_up_proj", e, (0, 1), (inter, hidden)) for e in range(experts.num_experts)]
            w2 = [self._unpack_stack(experts, "down_proj", e, (0,), (hidden, inter)) for e in range(experts.num_experts)]
        experts.int4_pending = {}
        if self.use_kernels:
            # float32 scales: AWQ / GPTQ store fp16 ones, which bf16 would round (3 bits fewer).
            (q13, s13, z13), (q2, s2, z2) = _kernel_form(w13, torch.float32), _kernel_form(w2, torch.float32)
            experts.gate_up_proj, experts.down_proj = _frozen(q13), _frozen(q2)
            # One group per row (group_size -1) is the kernels' None: G = H for gate/up, I for down.
            group = None if self.spec.group_size == -1 else w13[0].group_size
            experts.scales = Int4ExpertScales(s13, z13, s2, z2, group)
        else:
            experts.gate_up_proj = _frozen(torch.stack([_dequantized(f) for f in w13]).to(dtype))
            experts.down_proj = _frozen(torch.stack([_dequantized(f) for f in w2]).to(dtype))
            experts.scales = None

    def _quantize(self, stacked: torch.Tensor) -> list[QuantizedInt4]:
        group = stacked.shape[2] if self.spec.group_size == -1 else self.spec.group_size
        return [quantize_int4(w, group, symmetric=not self.spec.zero_point, scale_dtype=torch.float32) for w in stacked]

    def _unpack_stack(self, experts: MoEExperts, projection: str, expert: int, parts: tuple[int, ...],
                      shape: tuple[int, int]) -> QuantizedInt4:  # fmt: skip
        """One expert's projection (gate and up stacked) in the canonical form."""
        forms = []
        for part in parts:
            name = f"expert {expert} {projection}" + (f" part {part}" if len(parts) > 1 else "")
            tensors = {leaf: experts.int4_pending.get((projection, expert, part, leaf)) for leaf in self.accepted_leaves()}
            missing = [leaf for leaf in self.checkpoint_leaves() if tensors[leaf] is None]
            if missing:
                raise ValueError(f"{name}: the checkpoint holds no {', '.join(missing)}")
            form = self._unpack(tensors, shape[1], name)
            if tuple(form.q.shape) != shape:
                raise ValueError(f"{name}: unpacked to {tuple(form.q.shape)}, the model's is {shape}")
            forms.append(form)
        if len(forms) == 1:
            return forms[0]
        gate, up = forms
        return QuantizedInt4(
            torch.cat([gate.q, up.q]), torch.cat([gate.scales, up.scales]), torch.cat([gate.zeros, up.zeros]),
            gate.group_size, gate.g_idx,
        )  # fmt: skip

    def _unpack(self, t: dict, k: int, name: str) -> QuantizedInt4:
        spec = self.spec
        group = k if spec.group_size == -1 else spec.group_size
        if self.format == "awq":
            return unpack_awq(t["qweight"], t["qzeros"], t["scales"], group, layer=name)
        if self.format == "gptq":
            return unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], group, sym=not spec.zero_point,
                               zeros_offset=spec.gptq_zeros_offset, layer=name)  # fmt: skip
        return unpack_pack_quantized(t["weight_packed"], t["weight_scale"], t["weight_zero_point"],
                                     t["weight_g_idx"], group, weight_shape=t["weight_shape"], layer=name)  # fmt: skip


def _dequantized(form: QuantizedInt4) -> torch.Tensor:
    return dequantize_int4(form.q, form.scales, form.zeros, form.group_size, form.g_idx)


def _kernel_form(forms: list[QuantizedInt4], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int32 [E, N, K/8] in the kernels' packs, scales [E, N, G] in `dtype`, zeros uint8 [E, N, G])
    of the experts' canonical forms (groups in order: act-order was refused)."""
    # One group per row has group_size K here: the same packs as the kernels' None.
    words = pack_int4_experts(torch.stack([f.q for f in forms]), forms[0].group_size)
    scales = torch.stack([f.scales for f in forms]).to(dtype)
    zeros = torch.stack([f.zeros for f in forms]).to(torch.uint8)
    return words, scales.contiguous(), zeros.contiguous()


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)
