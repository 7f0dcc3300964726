"""FP8 (e4m3) routed-expert weights for the MoE blocks (layers/moe.py MoEExperts): the experts'
counterpart of the FP8 linear method (layers/fp8_linear.py), chosen with it.

Checkpoints store one tensor per expert and projection, in the layouts the dense layers read
(model/loader/quant_config.py parses which): `weight` e4m3 [N, K] and `weight_scale` per tensor
([] / [1]), per channel ([N] / [N, 1]) or per 128x128 block ([N/128, K/128]; Hugging Face `fp8`
names it `weight_scale_inv`), with static activation schemes an `input_scale` too (checked, not
used: the kernels keep 16-bit activations). 16-bit checkpoints under `--quantization fp8` are
quantized at load with per-channel scales, as the dense layers are.

In memory the experts hold what the kernels take (kernels/triton/fused_moe.py, W8A16):
gate_up_proj e4m3 [E, 2I, H] and down_proj e4m3 [E, H, I], with float32 scales either per output
row, [E, 2I] and [E, H] (per-tensor scales become that, exactly), or per block,
[E, 2I/bn, H/bk] and [E, H/bn, I/bk]. On the GPU they stay so (half the bytes a decode step
reads); elsewhere the weights are dequantized once after loading, the CPU's reference path
(TorchMoEOps multiplies the dequantized weights, which is what the tests compare with
transformers on).

The router and Qwen's shared-expert gate stay 16-bit (their checkpoints leave them unquantized,
and they are a sliver of the bytes); the shared expert is a dense MLP and takes the linear method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.model.layers.quantize_weights import FP8_DTYPE, dequantize_fp8, quantize_fp8_per_channel
from tokenmill.model.loader.quant_config import QuantizationSpec

if TYPE_CHECKING:
    from tokenmill.model.layers.moe import ExpertShard, MoEExperts

INPUT_SCALE_LEAF = "input_scale"


@dataclass(frozen=True, slots=True)
class ExpertScales:
    """The float32 scales of FP8 expert weights, in the layout fused_moe takes."""

    w13: torch.Tensor  # [E, 2I] per channel, or [E, 2I/bn, H/bk] per block
    w2: torch.Tensor  # [E, H] or [E, H/bn, I/bk]
    block: tuple[int, int] | None  # (bn, bk) of block scales; None: per channel

    def kernel_kwargs(self) -> dict:
        return {"w13_scale": self.w13, "w2_scale": self.w2, "scale_block": self.block}


class Fp8ExpertWeights:
    """Creates, loads and finishes FP8 expert weights on a MoEExperts (`experts.quant`)."""

    def __init__(self, spec: QuantizationSpec, *, use_kernels: bool) -> None:
        if spec.scheme != "fp8_w8a8":
            raise ValueError(f"{spec.describe()}: mixture-of-experts blocks take FP8 expert weights only")
        self.spec = spec
        self.use_kernels = use_kernels
        self.block = spec.fp8_block if spec.from_checkpoint and spec.fp8_weight_strategy == "block" else None

    # -- creation ---------------------------------------------------------------------------------

    def create_weights(self, experts: MoEExperts, *, device, dtype: torch.dtype) -> None:
        """Replace the 16-bit stacks by the checkpoint's FP8 ones and their scales (a checkpoint of
        16-bit weights quantized at load keeps the 16-bit stacks until process_after_loading)."""
        if not self.spec.from_checkpoint:
            return
        num, hidden, inter = experts.num_experts, experts.hidden_size, experts.intermediate_size
        f32 = {"device": device, "dtype": torch.float32}
        experts.gate_up_proj = _frozen(torch.empty((num, 2 * inter, hidden), device=device, dtype=FP8_DTYPE))
        experts.down_proj = _frozen(torch.empty((num, hidden, inter), device=device, dtype=FP8_DTYPE))
        if self.block is None:  # per tensor or per channel: per output row in memory
            gate_up_scale, down_scale = torch.empty((num, 2 * inter), **f32), torch.empty((num, hidden), **f32)
        else:
            bn, bk = self.block
            if inter % bn or (experts.tp_size > 1 and inter % bk):
                raise ValueError(
                    f"FP8 experts with {bn}x{bk} blocks need the expert intermediate size held by a rank ({inter}) "
                    f"to be a multiple of {bn} (the up rows start on a block) and, under tensor parallelism, of "
                    f"{bk} (a rank's down columns are whole blocks)"
                )
            gate_up_scale = torch.empty((num, 2 * inter // bn, -(-hidden // bk)), **f32)
            down_scale = torch.empty((num, -(-hidden // bn), -(-inter // bk)), **f32)
        experts.gate_up_scale = _frozen(gate_up_scale.fill_(float("nan")))  # unloaded scales poison, visibly
        experts.down_scale = _frozen(down_scale.fill_(float("nan")))
        if self.spec.fp8_static_input_scales:
            experts.gate_up_input_scale = _frozen(torch.ones((num, 2), **f32))
            experts.down_input_scale = _frozen(torch.ones((num, 1), **f32))

    def accepted_leaves(self) -> tuple[str, ...]:
        return self.checkpoint_leaves()

    def checkpoint_leaves(self) -> tuple[str, ...]:
        """The tensors each expert projection has in the checkpoint, besides `weight`."""
        if not self.spec.from_checkpoint:
            return ()
        return (self.spec.fp8_scale_name,) + ((INPUT_SCALE_LEAF,) if self.spec.fp8_static_input_scales else ())

    # -- loading ----------------------------------------------------------------------------------

    def check_weight(self, param_name: str, loaded: torch.Tensor) -> None:
        """An FP8 checkpoint's expert weight must be e4m3: a 16-bit one would be rounded to FP8
        without a scale by the copy."""
        if self.spec.from_checkpoint and loaded.dtype != FP8_DTYPE:
            raise ValueError(
                f"expected a float8_e4m3fn expert weight ({param_name}) in this FP8 checkpoint, got {loaded.dtype}"
            )

    def load_scale(self, experts: MoEExperts, param_name: str, loaded: torch.Tensor, shard_id: ExpertShard) -> None:
        """Copy one expert projection's scale (`gate_up_scale` / `down_scale`: its weight_scale or
        weight_scale_inv; `gate_up_input_scale` / `down_input_scale`: its static input_scale) into
        place; shard (e, 0 | 1) for gate / up, (e, None) for down."""
        if shard_id is None:
            raise ValueError(f"stacked {param_name} tensors are not read; this loader takes one tensor per expert")
        expert, part = shard_id
        if not 0 <= expert < experts.num_experts:
            raise ValueError(f"expert {expert} is outside this layer's {experts.num_experts} experts")
        loaded = loaded.float()
        gate_up = param_name.startswith("gate_up")
        # Under tensor parallelism a rank holds `local` of each expert's intermediate rows (gate, up)
        # and columns (down) from `start`, as MoEExperts.weight_loader narrows the weights.
        full, local = experts.full_intermediate_size, experts.intermediate_size
        start, hidden = experts.tp_rank * local, experts.hidden_size
        rows, cols = (full, hidden) if gate_up else (hidden, full)
        if param_name.endswith("input_scale"):
            if loaded.numel() != 1 or not bool(torch.isfinite(loaded).all()) or float(loaded.reshape(())) <= 0:
                raise ValueError(
                    f"input_scale {loaded.flatten().tolist()}: a static activation scale is one positive value"
                )
            getattr(experts, param_name).data[expert, part or 0] = loaded.reshape(())
            return
        scales = getattr(experts, param_name).data[expert]
        if self.block is not None:
            bn, bk = self.block
            _check_shape(loaded, (-(-rows // bn), -(-cols // bk)))
            if gate_up:  # this rank's block rows of the part (local is a multiple of bn)
                loaded = loaded.narrow(0, start // bn, local // bn)
                first = (part or 0) * (local // bn)
                scales[first : first + local // bn].copy_(loaded)
            else:  # this rank's block columns (local is a multiple of bk under tensor parallelism)
                scales.copy_(loaded.narrow(1, start // bk, scales.shape[1]))
            return
        held = local if gate_up else hidden  # a rank's rows of the part (down's rows are whole)
        first = (part or 0) * held
        if self.spec.fp8_weight_strategy == "tensor":
            if loaded.numel() != 1:
                raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's per-tensor scale (1,)")
            scales[first : first + held].fill_(float(loaded.reshape(())))
            return
        if tuple(loaded.shape) not in ((rows,), (rows, 1)):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's per-channel scale ({rows}, 1)")
        loaded = loaded.reshape(rows)
        scales[first : first + held].copy_(loaded.narrow(0, start, local) if gate_up else loaded)

    # -- after loading ----------------------------------------------------------------------------

    def process_after_loading(self, experts: MoEExperts, dtype: torch.dtype) -> None:
        """The kernels' FP8 form on the GPU (quantizing 16-bit weights at load), or the
        dequantized `dtype` weights elsewhere."""
        if self.spec.from_checkpoint:
            for name in ("gate_up_scale", "down_scale"):
                scale = getattr(experts, name)
                if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
                    raise ValueError(f"the experts' {name} holds non-positive or unloaded values")
            w13, s13 = experts.gate_up_proj.data, experts.gate_up_scale.data
            w2, s2 = experts.down_proj.data, experts.down_scale.data
        else:
            w13, s13 = _quantize_rows(experts.gate_up_proj.data)
            down_absmax = None
            if experts.tp_size > 1:
                # A rank holds some of each down row's columns: the row's scale comes from its absmax
                # over every rank's, so the ranks hold the one-rank model's FP8 values (as the dense
                # row-parallel layers do; every rank loads its experts in the same order).
                from tokenmill.distributed.parallel_state import all_reduce_max

                down_absmax = all_reduce_max(experts.down_proj.data.abs().amax(dim=2).float())
            w2, s2 = _quantize_rows(experts.down_proj.data, down_absmax)
        if self.use_kernels:
            experts.gate_up_proj, experts.down_proj = _frozen(w13.contiguous()), _frozen(w2.contiguous())
            experts.scales = ExpertScales(s13.contiguous(), s2.contiguous(), self.block)
        else:
            experts.gate_up_proj = _frozen(dequantize_experts(w13, s13, self.block).to(dtype))
            experts.down_proj = _frozen(dequantize_experts(w2, s2, self.block).to(dtype))
            experts.scales = None
        for name in ("gate_up_scale", "down_scale", "gate_up_input_scale", "down_input_scale"):
            if name in experts._parameters:
                delattr(experts, name)


def dequantize_experts(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 [E, N, K] = e4m3 [E, N, K] times its per-row [E, N] or per-block scales, expert by
    expert through the dense layers' dequantize_fp8."""
    return torch.stack([dequantize_fp8(w, s, block) for w, s in zip(weight, scale, strict=True)])


def _quantize_rows(w: torch.Tensor, row_absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row FP8 of 16-bit stacked weights [E, N, K]: (e4m3 [E, N, K], float32 [E, N]),
    the dense layers' quantize_fp8_per_channel over all the experts' rows at once (`row_absmax`
    [E, N]: each row's absmax over more columns than `w` holds)."""
    absmax = None if row_absmax is None else row_absmax.flatten()
    q, scale, _ = quantize_fp8_per_channel(w.flatten(0, 1), absmax)
    return q.view(w.shape), scale.view(w.shape[:2])


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's {expected}")


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)
