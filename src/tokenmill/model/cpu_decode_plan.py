"""A decode step's decoder layers in one C++ call on the CPU (kernels/cpu/csrc/cpu_decode_layers.cpp).

The Python layer loop of CausalLM.forward costs ~45 us a layer between the kernels at one decode
row (module calls, views, the attention backend's per-call checks): ~2.5-3 ms of the default
model's ~11-14 ms step. The C++ op runs the same kernels in the same order, so its outputs are the
loop's bit for bit; it only removes the Python between them.

It serves the models whose every layer is the plain path it replicates: a DecoderLayer with
SelfAttention (no Q/K norms, no soft cap or sinks, one KV cache group) and a SwiGLU MLP, whose four
products are GGUF blocks in the integer-activation layout (GGUFBlocksMethod, nothing wrapping it:
LoRA and the like keep the loop), with no bias but Qwen2's on q/k/v, on the C++ attention backend, one rank, float32.
Per step: decode-sized steps only (every query chunk within the attention kernel's limit, no
padding rows, no KV connector hooks), and rows the blocks serve. Everything else runs the loop.
KernelConfig.fused_decode_layers turns it off.
"""

from __future__ import annotations

from operator import is_
from typing import TYPE_CHECKING

import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.attention.cpu_paged import CpuPagedBackend
from tokenmill.kernels.cpu.quant_gemv import gemm_vnni16_available, int8_rows_limit
from tokenmill.model.layers.attention import SelfAttention
from tokenmill.model.layers.layer_ops import RopeInputs
from tokenmill.model.layers.mlp import SwiGLUMLP
from tokenmill.model.layers.quantized_linear import GGUFBlocksMethod

if TYPE_CHECKING:
    from tokenmill.model.llama import CausalLM


class CpuDecodePlan:
    """What the op needs from a model, gathered once; `why_not` is None where it can serve it."""

    def __init__(self, model: CausalLM) -> None:
        from tokenmill.model.llama import DecoderLayer

        self.why_not: str | None = None
        self.linears = [
            linear
            for layer in model.layers
            if isinstance(getattr(layer, "self_attn", None), SelfAttention)
            and isinstance(getattr(layer, "mlp", None), SwiGLUMLP)
            for linear in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        ]
        # The linear methods as gathered: a later swap (an adapter wrapping them) retires the plan.
        self.methods = tuple(linear.method for linear in self.linears)
        backend = model.attn_backend
        problems = []
        if model.tp_size != 1:
            problems.append(f"tensor parallelism ({model.tp_size} ranks)")
        if not isinstance(backend, CpuPagedBackend):
            problems.append(f"the {backend.name} attention backend")
        if model.embed_tokens.dtype != torch.float32:
            problems.append(f"{model.embed_tokens.dtype} activations")
        for index, layer in enumerate(model.layers):
            problem = _layer_problem(layer, DecoderLayer)
            if problem is not None:
                problems.append(f"layer {index}: {problem}")
                break
        if not problems and len({_attention_shape(layer) for layer in model.layers}) != 1:
            problems.append("layers of different attention shapes")
        if problems:
            self.why_not = "; ".join(problems)
            return
        self.backend: CpuPagedBackend = backend
        first = model.layers[0]
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.eps = first.eps
        self.norms = [
            norm
            for layer in model.layers
            for norm in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        ]
        blocks = [method.blocks for method in self.methods]
        self.weights = [b.vnni for b in blocks]
        self.quant_types = [b.quant_type for b in blocks]
        self.activation_bits = [b.activation_bits for b in blocks]
        # Qwen2's q/k/v bias (one a layer, or none); no other product may have one (_layer_problem).
        biases = [layer.self_attn.qkv_proj._applied_bias for layer in model.layers]
        self.qkv_biases = [] if all(b is None for b in biases) else biases
        if self.qkv_biases and any(b is None or b.dtype != torch.float32 for b in biases):
            self.why_not = "q/k/v biases on some layers only, or not float32"
            return
        self.sliding_windows = [layer.self_attn.layer_spec.sliding_window or 0 for layer in model.layers]
        self.few_rows_limit = int8_rows_limit()
        # Above the few-row kernel's rows the products take the batched 16-bit kernel (where built).
        self.max_rows = min(method.max_rows for method in self.methods)
        if not gemm_vnni16_available():
            self.max_rows = min(self.max_rows, self.few_rows_limit)
        self._op = torch.ops.tokenmill_cpu.decode_layers.default

    def current(self, model: CausalLM) -> bool:
        """Whether the model's linear methods are still the ones gathered."""
        return all(map(is_, (linear.method for linear in self.linears), self.methods))

    def applies(self, meta: AttentionMetadata, rows: int, rope: RopeInputs) -> bool:
        """Whether this step goes through the op (see the module's docstring)."""
        return (
            0 < rows <= self.max_rows
            and meta.num_actual_tokens == rows
            and meta.max_query_len <= self.backend.max_kernel_query_len
            and meta.kv_layer_hooks is None
            and not meta.kv_group_siblings
            and rope.cos is not None
            and rope.cos.dtype == torch.float32
            and rope.cos.is_contiguous()
            and rope.signed_sin is not None
            and rope.signed_sin.is_contiguous()
        )

    def __call__(
        self, x: torch.Tensor, rope: RopeInputs, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer loop's (x, pending): x updated in place, the last layer's MLP output."""
        starts, seq_lens, tables, slots = self.backend.kernel_tensors(meta)
        pending = self._op(
            x, None, self.norms, self.weights, self.quant_types, self.activation_bits, self.qkv_biases, kv_caches,
            rope.cos, rope.signed_sin, starts, seq_lens, tables, slots,
            self.num_heads, self.num_kv_heads, self.head_dim, self.backend.scale, self.eps,
            self.backend.max_kernel_query_len, self.sliding_windows, self.few_rows_limit,
        )  # fmt: skip
        return x, pending


def _layer_problem(layer, decoder_layer_type: type) -> str | None:
    """What in `layer` the op does not replicate, or None."""
    if type(layer) is not decoder_layer_type:
        return f"{type(layer).__name__} layers"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not SelfAttention or type(mlp) is not SwiGLUMLP:
        return f"{type(attn).__name__} / {type(mlp).__name__}"
    if layer.norms_folded:
        return "norm weights folded into the products"
    if attn.q_norm is not None:
        return "Q/K norms"
    if attn.kv_group:
        return "several KV cache groups"
    spec = attn.layer_spec
    if spec.logits_soft_cap is not None or spec.sinks is not None:
        return "attention soft cap or sinks"
    for norm in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight):
        if norm.dtype != torch.float32 or not norm.is_contiguous():
            return "norm weights that are not contiguous float32"
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        method = linear.method
        if type(method) is not GGUFBlocksMethod:
            return f"{type(method).__name__} products"
        if method.blocks.vnni is None:
            return "GGUF blocks without the integer-activation layout"
        if linear._applied_bias is not None and linear is not attn.qkv_proj:
            return "an o_proj or MLP bias"
    return None


def _attention_shape(layer) -> tuple:
    attn = layer.self_attn
    return attn.num_heads, attn.num_kv_heads, attn.head_dim, layer.eps
