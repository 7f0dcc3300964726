"""The elementwise ops around a decoder layer's matmuls, one set per device, chosen once at load.

The decoders (model/llama.py, model/gemma.py) are written once against these: add the pending
residual and RMSNorm (Llama's rounding order, or Gemma's float32 weight), rotate q/k, silu(gate) * up
or gelu(gate) * up. On the CPU they are plain PyTorch ops; on CUDA our fused
Triton launches (kernels/triton/elementwise.py), which also declare that they can store K/V in the RoPE
launch. The residual add is deferred into the next norm (`pending`) on both: the CPU adds it
there in its own op, CUDA inside the norm's launch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import QKNorm
from tokenmill.model.layers.rmsnorm import rms_norm, rms_norm_float32_weight
from tokenmill.model.layers.rotary import RotaryEmbedding, apply_rotary


@dataclass(slots=True)
class RopeInputs:
    """One step's RoPE inputs: the positions and the full tables (for launches that gather
    themselves), and the rows gathered for the positions where the ops want them."""

    positions: torch.Tensor  # [T] int64
    cos_cache: torch.Tensor  # RotaryEmbedding's tables
    sin_cache: torch.Tensor
    cos: torch.Tensor | None = None  # [T, 1, head_dim], gathered
    signed_sin: torch.Tensor | None = None


# (x, rope, kv_caches, meta) -> (x, pending): a step's decoder layers in one call, as the model's
# layer loop returns them (x, the residual stream, updated in place; the last layer's MLP output).
FusedDecodeLayers = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class TorchLayerOps:
    # Whether rotate_and_store_kv exists: RoPE and the KV store in one launch.
    stores_kv_in_rope = False
    # Whether rotate / rotate_and_store_kv take a layer's Q/K norms (else the layer norms first).
    applies_qk_norm_in_rope = False

    def rope_inputs(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> RopeInputs:
        cos, signed_sin = rotary(positions)
        return RopeInputs(positions, rotary.cos_cache, rotary.sin_cache, cos, signed_sin)

    def add_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, pending: torch.Tensor | None,
        weight_in_float32: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """x += pending (in place, when given), then RMSNorm(x) (scaled by `weight` unless None).
        `weight_in_float32`: `weight` is float32 and scales the float32 normalized value before
        the one rounding to x's dtype (Gemma's order) instead of after it (Llama's)."""
        if pending is not None:
            x.add_(pending)
        if weight is None:
            normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
            return normed if x.dtype == torch.float32 else normed.to(x.dtype)
        if weight_in_float32:
            return rms_norm_float32_weight(x, weight, eps)
        return rms_norm(x, weight, eps)

    def rotate(self, x: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        """x [T, heads, head_dim] rotated (a new tensor here; CUDA rotates in place)."""
        return apply_rotary(x, rope.cos, rope.signed_sin)

    def rotate_and_store_kv(
        self, qk: torch.Tensor, num_q_heads: int, v: torch.Tensor, rope: RopeInputs,
        kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        raise NotImplementedError("the PyTorch ops store K/V through the attention backend")

    def fused_decode_layers(self, model, meta, rows: int, rope: RopeInputs) -> FusedDecodeLayers | None:
        """This step's decoder layers of `model` as one call, where these ops have one for the model
        and the step; None = the model runs its layer loop."""
        return None

    def silu_mul(
        self, gate_up: torch.Tensor, norm_source: torch.Tensor | None = None, eps: float = 0.0
    ) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 * intermediate], gate columns first."""
        if norm_source is not None:
            raise NotImplementedError("the PyTorch ops have no deferred RMSNorm")
        intermediate = gate_up.shape[-1] // 2
        # silu in place on the gate half of a buffer we own, then one multiply into a fresh tensor
        return F.silu(gate_up[..., :intermediate], inplace=True) * gate_up[..., intermediate:]

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate) (tanh approximation) * up for gate_up [T, 2 * intermediate]: GeGLU."""
        intermediate = gate_up.shape[-1] // 2
        return F.gelu(gate_up[..., :intermediate], approximate="tanh") * gate_up[..., intermediate:]


class CpuNativeLayerOps(TorchLayerOps):
    """TorchLayerOps with the residual add + RMSNorm, RoPE and silu * up of float32 rows in one C++ call each
    (kernels/cpu/csrc/cpu_layer_ops.cpp): at one decode row F.rms_norm's five op dispatches cost
    ~20 us a call (~1.3 ms of a SmolLM2-135M step), RoPE's mul / roll / addcmul ~20 us a layer.
    The same float32 arithmetic up to the summation order of the mean square (and FMA contraction).
    Other dtypes and layouts keep the PyTorch ops."""

    def __init__(self) -> None:
        from tokenmill.kernels.cpu.build import load_cpu_kernels

        load_cpu_kernels()
        self._decode_plan = None  # model/cpu_decode_plan.CpuDecodePlan, gathered at the first step
        # The resolved overloads: a call skips the op packet's overload lookup (~2 us; a one-row
        # decode step of a 30-layer model makes ~120 of these calls).
        ops = torch.ops.tokenmill_cpu
        self._add_rms_norm = ops.add_rms_norm.default
        self._rotate = ops.rotate.default
        self._silu_mul = ops.silu_mul.default

    def add_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, pending: torch.Tensor | None,
        weight_in_float32: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        if (
            x.dtype == torch.float32
            and x.dim() == 2
            and x.is_contiguous()
            and (pending is None or (pending.dtype == torch.float32 and pending.is_contiguous()))
            and (weight is None or weight.dtype == torch.float32)
        ):
            # float32 x: Llama's and Gemma's orders (weight_in_float32) are the same arithmetic.
            return self._add_rms_norm(x, pending, weight, eps)
        return super().add_rms_norm(x, weight, eps, pending, weight_in_float32)

    def rotate(self, x: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        cos, signed_sin = rope.cos, rope.signed_sin
        if (
            x.dtype == torch.float32
            and x.dim() == 3
            and x.stride(2) == 1
            and cos is not None
            and signed_sin is not None
            and cos.dtype == signed_sin.dtype == torch.float32
            and cos.is_contiguous()
            and signed_sin.is_contiguous()
        ):
            return self._rotate(x, cos, signed_sin)
        return super().rotate(x, rope)

    def fused_decode_layers(self, model, meta, rows: int, rope: RopeInputs) -> FusedDecodeLayers | None:
        # One model per ops object (CausalLM builds its own): its plan is gathered once, and again
        # if its linear methods change (kernels/cpu/csrc/cpu_decode_layers.cpp; the plan's module
        # says what it serves).
        plan = self._decode_plan
        if plan is None or not plan.current(model):
            from tokenmill.model.cpu_decode_plan import CpuDecodePlan

            plan = self._decode_plan = CpuDecodePlan(model)
        return plan if plan.why_not is None and plan.applies(meta, rows, rope) else None

    def silu_mul(
        self, gate_up: torch.Tensor, norm_source: torch.Tensor | None = None, eps: float = 0.0
    ) -> torch.Tensor:
        if norm_source is None and gate_up.dtype == torch.float32 and gate_up.dim() == 2 and gate_up.is_contiguous():
            return self._silu_mul(gate_up)
        return super().silu_mul(gate_up, norm_source, eps)


class TritonLayerOps:
    stores_kv_in_rope = True
    # rotate / rotate_and_store_kv take a layer's Q/K norm weights and apply them in the same launch.
    applies_qk_norm_in_rope = True

    def __init__(self) -> None:
        # Imported here: triton is optional on CPU-only installs.
        from tokenmill.kernels.triton import elementwise as triton_ops

        self._ops = triton_ops

    def rope_inputs(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> RopeInputs:
        return RopeInputs(positions, rotary.cos_cache, rotary.sin_cache)

    def fused_decode_layers(self, model, meta, rows: int, rope: RopeInputs) -> FusedDecodeLayers | None:
        return None  # CUDA graphs take a decode step's Python out of the loop instead

    def add_rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, pending: torch.Tensor | None,
        weight_in_float32: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        return self._ops.add_rms_norm(x, weight, eps, pending, weight_in_float32=weight_in_float32)

    def rotate(
        self, x: torch.Tensor, rope: RopeInputs, qk_norm: QKNorm | None = None, num_q_heads: int = 0
    ) -> torch.Tensor:
        """Rotate x in place; with `qk_norm`, x is [T, q heads + kv heads, head_dim] (k heads from
        `num_q_heads` on) and each head is normalized first."""
        self._ops.rope_inplace(
            x, rope.positions, rope.cos_cache, rope.sin_cache, qk_norm=qk_norm, first_kv_head=num_q_heads
        )
        return x

    def rotate_and_store_kv(
        self, qk: torch.Tensor, num_q_heads: int, v: torch.Tensor, rope: RopeInputs,
        kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
        qk_norm: QKNorm | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Rotate qk [T, q heads + kv heads, head_dim] in place (with `qk_norm`: each head
        normalized first) and store its K heads and v (an FP8 cache: divided by the per-KV-head
        scales, see kernels/kv_fp8.py)."""
        self._ops.rope_and_store_kv(
            qk, num_q_heads, v, rope.positions, rope.cos_cache, rope.sin_cache, kv_cache, slot_mapping,
            k_scale=k_scale, v_scale=v_scale, qk_norm=qk_norm,
        )  # fmt: skip
        return qk

    def silu_mul(
        self, gate_up: torch.Tensor, norm_source: torch.Tensor | None = None, eps: float = 0.0
    ) -> torch.Tensor:
        if norm_source is None:
            return self._ops.silu_mul(gate_up)
        return self._ops.silu_mul(gate_up, norm_source=norm_source, eps=eps)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ops.gelu_tanh_mul(gate_up)


LayerOps = TorchLayerOps | TritonLayerOps


def select_layer_ops(device: torch.device | str) -> LayerOps:
    """Triton on CUDA; on the CPU the C++ ops where the CPU kernels build, else plain PyTorch."""
    if torch.device(device).type == "cuda":
        return TritonLayerOps()
    from tokenmill.kernels.cpu.build import cpu_kernels_available

    return CpuNativeLayerOps() if cpu_kernels_available()[0] else TorchLayerOps()
