"""The sparse mixture-of-experts block: a router, top-k routed SwiGLU experts and, for Qwen2-MoE,
a shared expert every token goes through.

    gate logits = x @ W_router.T                    [T, E], in the model's dtype (as transformers)
    weights, ids = top-k of softmax(logits)          (renormalized to sum to 1 where the model says)
    y = sum_k weights[:, k] * expert_{ids[:, k]}(x)  each expert down(silu(gate(x)) * up(x))
      (+ sigmoid(x @ w_shared_gate) * shared_expert(x))

The experts' weights live stacked on the device: gate_up_proj [E, 2I, H] (an expert's gate rows,
then its up rows) and down_proj [E, H, I], the layout transformers 5 keeps in memory. How they
run is the device's `MoEOps`, picked once at load like the layer ops:

- CUDA (`TritonMoEOps`): routing in one Triton launch, then kernels/triton/fused_moe.py (pairs
  aligned to expert blocks, one grouped GEMM for gate/up with SiLU-and-mul in its epilogue, one
  for down with the routing weight in its epilogue, a sum over k); for a few tokens (decode
  steps, as the tile configs say) two GEMV launches of fused_moe_gemv.py, the first also routing.
  No host syncs: it can sit in a CUDA graph.
- CPU (`TorchMoEOps`): transformers' routing ops, then the pairs sorted by expert and one pair
  of matmuls per expert that got tokens (a loop over those only, not over all E), whose weighted
  outputs are index_add-ed into the result. With 16-bit weights (`CpuGemv16MoEOps`,
  KernelConfig.cpu_gemv16) up to four tokens go through one C++ call with the same roundings
  (kernels/cpu/csrc/cpu_gemv16.cpp moe_experts16), and the loop's few-row products through the
  C++ 16-bit GEMV.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.distributed.parallel_state import all_reduce
from tokenmill.model.layers.layer_ops import LayerOps
from tokenmill.model.layers.linear import ReplicatedLinear, bind_hot_path
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.layers.mlp import SwiGLUMLP
from tokenmill.model.layers.moe_fp8 import ExpertScales, Fp8ExpertWeights
from tokenmill.model.layers.moe_int4 import Int4ExpertScales, Int4ExpertWeights
from tokenmill.model.layers.quantized_method import QuantizedLinearMethod
from tokenmill.model.moe_config import MoEConfig

# A checkpoint tensor's place in the stacked expert weights: (expert, 0 = gate / 1 = up / None =
# down); None for a whole stacked tensor (transformers 5's in-memory layout).
ExpertShard = tuple[int, int | None] | None


class TorchMoEOps:
    """Routing and experts with PyTorch ops (the CPU's)."""

    def route(
        self, logits: torch.Tensor, top_k: int, renormalize: bool, weights_in_model_dtype: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) by transformers' ops: softmax in float32, top-k,
        renormalize; weights in the logits' dtype or float32."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return (weights.to(logits.dtype) if weights_in_model_dtype else weights), ids

    def forward(
        self, x: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
        top_k: int, renormalize: bool, weights_in_model_dtype: bool,
        scales: ExpertScales | Int4ExpertScales | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """The routed experts' output [T, H] for router logits [T, E]."""
        if scales is not None:
            raise ValueError("the torch MoE ops multiply dequantized expert weights; scales go to the Triton ops")
        weights, ids = self.route(router_logits, top_k, renormalize, weights_in_model_dtype)
        return self.experts(x, gate_up_proj, down_proj, weights, ids)

    def experts(
        self,
        x: torch.Tensor,  # [T, H]
        gate_up_proj: torch.Tensor,  # [E, 2I, H]
        down_proj: torch.Tensor,  # [E, H, I]
        topk_weights: torch.Tensor,  # [T, k]
        topk_ids: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:
        inter = down_proj.shape[2]
        linear = self._linear

        def expert_output(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = linear(rows, gate_up_proj[expert])
            return linear(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], down_proj[expert])

        return experts_by_sorted_pairs(x, topk_weights, topk_ids, gate_up_proj.shape[0], expert_output)

    @staticmethod
    def _linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One expert's product, rows [n, in] @ weight [out, in]^T."""
        return F.linear(rows, weight)


def experts_by_sorted_pairs(
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    num_experts: int,
    expert_output: Callable[[int, torch.Tensor], torch.Tensor],  # (expert, its rows [n, H]) -> [n, H]
) -> torch.Tensor:
    """The CPU's routed experts: token-expert pairs sorted by expert, `expert_output` called once per
    expert that got tokens (never for the empty ones), each output scaled by its routing weight and
    added into its token's row. [T, H] in x's dtype."""
    top_k = topk_ids.shape[1]
    expert_of_pair = topk_ids.reshape(-1)
    order = torch.argsort(expert_of_pair, stable=True)  # pairs grouped by expert
    counts = torch.bincount(expert_of_pair, minlength=num_experts)
    used = counts.nonzero().flatten()
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order]
    rows = x[tokens]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in zip(used.tolist(), counts[used].tolist(), strict=True):
        end = start + count
        y = expert_output(expert, rows[start:end]) * weights[start:end, None]
        out.index_add_(0, tokens[start:end], y.to(out.dtype))
        start = end
    return out


class TritonMoEOps:
    """Routing and experts in Triton launches (CUDA; the CPU under TRITON_INTERPRET=1)."""

    def __init__(self) -> None:
        # Imported here: triton is optional on CPU-only installs.
        from tokenmill.kernels.triton import fused_moe, moe_routing

        self._fused_moe = fused_moe.fused_moe
        self._routed_fused_moe = fused_moe.routed_fused_moe
        self._routed_fused_moe_from_residual = fused_moe.routed_fused_moe_from_residual
        self._takes_residual = fused_moe.takes_residual
        self._topk_softmax = moe_routing.topk_softmax

    def forward(
        self, x: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
        top_k: int, renormalize: bool, weights_in_model_dtype: bool,
        scales: ExpertScales | Int4ExpertScales | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Routing and experts together: a few tokens route inside the experts' first launch. With
        `scales`, the expert weights are FP8 or 4-bit (W8A16 / W4A16 in the same kernels)."""
        return self._routed_fused_moe(
            x, router_logits, gate_up_proj, down_proj, top_k, renormalize, weights_in_model_dtype,
            **(scales.kernel_kwargs() if scales is not None else {}),
        )  # fmt: skip

    def takes_residual(self, num_tokens: int, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, top_k: int) -> bool:
        """Whether forward_from_residual serves a step of `num_tokens` tokens (the few-token GEMVs)."""
        return self._takes_residual(num_tokens, gate_up_proj, down_proj, top_k)

    def forward_from_residual(
        self, x: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
        top_k: int, renormalize: bool, weights_in_model_dtype: bool, eps: float,
    ) -> torch.Tensor:  # fmt: skip
        """x + forward(RMSNorm(x)), x the residual stream, the norm weight folded into the router
        and gate_up_proj: the two GEMV launches apply 1/rms and add the residual."""
        return self._routed_fused_moe_from_residual(
            x, router_logits, gate_up_proj, down_proj, top_k, renormalize, weights_in_model_dtype, eps
        )

    def route(
        self, logits: torch.Tensor, top_k: int, renormalize: bool, weights_in_model_dtype: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, rounded to the logits' dtype if asked; ids [T, k] int32)."""
        return self._topk_softmax(logits, top_k, renormalize, round_to_logits_dtype=weights_in_model_dtype)

    def experts(
        self,
        x: torch.Tensor,
        gate_up_proj: torch.Tensor,
        down_proj: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return self._fused_moe(x, gate_up_proj, down_proj, topk_weights, topk_ids)


class CpuGemv16MoEOps(TorchMoEOps):
    """The CPU's ops with 16-bit experts on the C++ 16-bit GEMV (KernelConfig.cpu_gemv16;
    kernels/cpu/gemv16.py): up to four tokens (decode steps) in one call for all their experts
    (`moe_experts16`: each used expert's weights read once, TorchMoEOps' roundings), more tokens
    through the per-expert loop with few-row products on the GEMV and F.linear elsewhere. A decode
    step's experts were 16 one-row F.linear calls a layer plus ~100 small ops between them."""

    def experts(
        self,
        x: torch.Tensor,  # [T, H]
        gate_up_proj: torch.Tensor,  # [E, 2I, H]
        down_proj: torch.Tensor,  # [E, H, I]
        topk_weights: torch.Tensor,  # [T, k]
        topk_ids: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:
        from tokenmill.kernels.cpu.gemv16 import moe_experts16, serves_experts

        if serves_experts(x, gate_up_proj, down_proj):
            return moe_experts16(x, gate_up_proj, down_proj, topk_weights, topk_ids)
        return super().experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)

    @staticmethod
    def _linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        from tokenmill.kernels.cpu.gemv16 import linear16

        return linear16(rows, weight)


MoEOps = TorchMoEOps | TritonMoEOps


def select_moe_ops(device: torch.device | str, cpu_gemv16: bool = True) -> MoEOps:
    if torch.device(device).type == "cuda":
        return TritonMoEOps()
    return CpuGemv16MoEOps() if cpu_gemv16 else TorchMoEOps()


class MoEExperts(nn.Module):
    """E SwiGLU experts' weights, stacked: gate_up_proj [E, 2I, H], down_proj [E, H, I].

    With tensor parallelism (vLLM's TP-MoE) every rank holds every expert, each cut along its
    intermediate dimension: rank r of n keeps rows [r * I/n, (r + 1) * I/n) of each expert's gate
    and of its up (column-parallel) and the same columns of its down (row-parallel). A rank's
    experts then output partial sums that the block all-reduces once; the router stays whole."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, device=None,
        dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
        quant: ExpertQuantization | None = None,
    ) -> None:  # fmt: skip
        """`quant`: the experts' weights are FP8 (layers/moe_fp8.py) or 4-bit (layers/moe_int4.py):
        in the checkpoint, or quantized at load."""
        super().__init__()
        dtype = dtype or torch.float32
        if intermediate_size % tp_size:
            raise ValueError(
                f"the experts' intermediate size ({intermediate_size}) is not divisible by the "
                f"tensor-parallel size {tp_size}"
            )
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.full_intermediate_size = intermediate_size  # of the checkpoint's experts
        self.intermediate_size = intermediate_size // tp_size  # this rank's share
        local = self.intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty((num_experts, 2 * local, hidden_size), device=device, dtype=dtype),
            requires_grad=False,
        )
        self.down_proj = nn.Parameter(
            torch.empty((num_experts, hidden_size, local), device=device, dtype=dtype),
            requires_grad=False,
        )
        self.quant = quant
        self.dtype = dtype
        # Set after loading, for the quantized weights the kernels read (None: 16-bit or dequantized).
        self.scales: ExpertScales | Int4ExpertScales | None = None
        if quant is not None:
            quant.create_weights(self, device=device, dtype=dtype)

    @torch.no_grad()
    def weight_loader(self, param_name: str, loaded: torch.Tensor, shard_id: ExpertShard = None) -> None:
        """Copy this rank's part of a checkpoint tensor into `param_name` ("gate_up_proj" or
        "down_proj"): one expert's gate, up or down matrix (shard_id = (expert, 0 | 1 | None)), or
        the whole stack (None). FP8 experts also take each projection's scales
        (`gate_up_scale`, `down_scale`, and static `gate_up_input_scale` / `down_input_scale`)."""
        if isinstance(self.quant, Fp8ExpertWeights) and param_name in _FP8_SCALE_PARAMS:
            self.quant.load_scale(self, param_name, loaded, shard_id)
            return
        if isinstance(self.quant, Int4ExpertWeights) and ":" in param_name:  # "gate_up_proj:qweight"
            projection, leaf = param_name.split(":", 1)
            self.quant.load_leaf(self, projection, leaf, loaded, shard_id)
            return
        if param_name not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"no such {param_name}; the experts hold gate_up_proj and down_proj")
        if isinstance(self.quant, Fp8ExpertWeights):
            self.quant.check_weight(param_name, loaded)
        elif self.quant is not None and self.quant.format is not None:
            raise ValueError(f"a 16-bit {param_name} in a {self.quant.spec.method} checkpoint, whose experts are 4-bit")
        param: torch.Tensor = getattr(self, param_name).data
        if shard_id is None:
            for expert, matrix in enumerate(self._checked_stack(param_name, loaded).unbind(0)):
                if param_name == "down_proj":
                    self.weight_loader(param_name, matrix, (expert, None))
                else:
                    for part, half in enumerate(matrix.chunk(2, dim=0)):
                        self.weight_loader(param_name, half, (expert, part))
            return
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is outside this layer's {self.num_experts} experts")
        param = param[expert]
        full, local = self.full_intermediate_size, self.intermediate_size
        start = self.tp_rank * local
        if param_name == "gate_up_proj":
            if part not in (0, 1):
                raise ValueError(f"gate_up_proj takes part 0 (gate) or 1 (up), not {part!r}")
            _check_expert_shape(loaded, (full, self.hidden_size))
            param[part * local : (part + 1) * local].copy_(loaded.narrow(0, start, local))
        else:
            _check_expert_shape(loaded, (self.hidden_size, full))
            param.copy_(loaded.narrow(1, start, local))

    def _checked_stack(self, param_name: str, loaded: torch.Tensor) -> torch.Tensor:
        rows, cols = (
            (2 * self.full_intermediate_size, self.hidden_size)
            if param_name == "gate_up_proj"
            else (self.hidden_size, self.full_intermediate_size)
        )
        _check_expert_shape(loaded, (self.num_experts, rows, cols))
        return loaded

    def process_weights_after_loading(self) -> None:
        """Quantized experts: the kernels' form on the GPU, dequantized weights elsewhere."""
        if self.quant is not None:
            self.quant.process_after_loading(self, self.dtype)


_FP8_SCALE_PARAMS = ("gate_up_scale", "down_scale", "gate_up_input_scale", "down_input_scale")
ExpertQuantization = Fp8ExpertWeights | Int4ExpertWeights


def process_experts_after_loading(model: nn.Module) -> None:
    """Let every MoE block's experts put their loaded weights in the form they multiply."""
    for module in model.modules():
        if isinstance(module, MoEExperts):
            module.process_weights_after_loading()


def _check_expert_shape(loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != expected:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the model's {expected}")


class SparseMoEBlock(nn.Module):
    """Router + routed experts (+ the shared expert and its gate where the config has one); the
    module names follow Qwen's checkpoints (mlp.gate, mlp.experts, mlp.shared_expert,
    mlp.shared_expert_gate)."""

    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        ops: LayerOps,
        moe_ops: MoEOps,
        *,
        linear_method: LinearMethod | None = None,
        expert_quant: ExpertQuantization | None = None,
        device=None,
        dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """`tp_rank` of `tp_size`: the share of every expert's (and the shared expert's)
        intermediate dimension this block holds; the router and the shared expert's gate are whole.
        `expert_quant`: the routed experts' weights are FP8 or 4-bit (layers/moe_fp8.py, moe_int4.py)."""
        super().__init__()
        place = {"device": device, "dtype": dtype}
        shard = {"tp_rank": tp_rank, "tp_size": tp_size}
        # The router (and below the shared expert's gate) stays 16-bit under a quantized method:
        # quantized checkpoints leave it so.
        router_method = linear_method.base if isinstance(linear_method, QuantizedLinearMethod) else linear_method
        self.gate = ReplicatedLinear(hidden_size, moe.num_experts, method=router_method, **place)
        self.experts = MoEExperts(
            moe.num_experts, hidden_size, moe.expert_intermediate_size, quant=expert_quant, **shard, **place
        )
        if moe.shared_expert_intermediate_size:
            # Its down_proj leaves the partial sum: the block all-reduces once, routed + shared.
            self.shared_expert = SwiGLUMLP(
                hidden_size, moe.shared_expert_intermediate_size, ops, linear_method=linear_method,
                reduce_results=False, **shard, **place,
            )  # fmt: skip
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, method=router_method, **place)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.weights_in_model_dtype = moe.weights_in_model_dtype
        self.moe_ops = moe_ops
        self.ops = ops
        bind_hot_path(self, router=self.gate, experts_=self.experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output [T, hidden], not yet added to the residual stream."""
        experts = self._experts_
        out = self.moe_ops.forward(
            x, self._router(x), experts.gate_up_proj, experts.down_proj, self.top_k, self.renormalize,
            self.weights_in_model_dtype, experts.scales,
        )  # fmt: skip
        if self.shared_expert is not None:
            # This rank's partial of the shared expert; the gate (whole on every rank) scales the
            # partials as it would their sum.
            shared = self.shared_expert(x) * torch.sigmoid(self.shared_expert_gate(x))
            out = out + shared
        return all_reduce(out)  # this rank's experts' partial sums -> the whole output (one rank: as is)

    # Called once per layer per step: skip nn.Module.__call__'s hook dispatch (see LinearBase.__call__).
    __call__ = forward

    # -- the deferred norm (model/llama.DecoderLayer._forward_deferred_norm) ----------------------

    def can_fold_input_scale(self) -> bool:
        """Whether the post-attention norm's weight can go into the router and the experts'
        gate/up: only for the Triton ops (their GEMV launches apply 1/rms), a router whose method
        folds, 16-bit experts, no shared expert and one rank (its gate and the all-reduce have no
        place for it)."""
        return (
            isinstance(self.moe_ops, TritonMoEOps)
            and self.shared_expert is None
            and self.experts.tp_size == 1
            and self.gate.method.folds_input_scale
            and self.experts.quant is None  # (quantized at load, experts are still 16-bit at the first fold)
            and self.experts.gate_up_proj.dtype in (torch.bfloat16, torch.float16, torch.float32)
        )

    @torch.no_grad()
    def fold_input_scale(self, scale: torch.Tensor) -> None:
        """W <- W * scale along the hidden dimension for the router and every expert's gate/up rows
        (rounded once), as LinearBase.fold_input_scale does for a dense MLP."""
        if not self.can_fold_input_scale():
            raise ValueError("this MoE block cannot fold its input norm's weight (see can_fold_input_scale)")
        self.gate.fold_input_scale(scale)
        self.experts.gate_up_proj.mul_(scale.to(self.experts.gate_up_proj.dtype))

    def forward_from_residual(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """x + forward(RMSNorm(x)) after fold_input_scale, x the residual stream: the router projects
        the un-normalized rows and, for a few tokens, the experts' two launches apply 1/rms and add
        x in the down epilogue; otherwise one norm launch first, as forward's caller would."""
        experts = self._experts_
        w13, w2 = experts.gate_up_proj, experts.down_proj
        if self.moe_ops.takes_residual(x.shape[0], w13, w2, self.top_k):
            return self.moe_ops.forward_from_residual(
                x, self._router(x), w13, w2, self.top_k, self.renormalize, self.weights_in_model_dtype, eps
            )
        normed = self.ops.add_rms_norm(x, None, eps, None)  # the weight is folded in
        return x + self.forward(normed)


def unread_expert_bytes(model: nn.Module) -> int:
    """Bytes of routed-expert weights a one-token decode step does not read: of each MoE block's
    E experts it reads top_k (the active-parameter count of a MoE model)."""
    unread = 0
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, MoEExperts):  # SparseMoEBlock, gpt-oss's GptOssMoEBlock
            per_expert = sum(p[0].numel() * p.element_size() for p in (experts.gate_up_proj, experts.down_proj))
            unread += (experts.num_experts - module.top_k) * per_expert
    return unread
