"""Gemma 2 and Gemma 3 (text): llama.py's decoder with Gemma's differences.

A layer is: input norm -> attention -> post-attention norm -> residual add -> pre-feed-forward
norm -> GeGLU MLP -> post-feed-forward norm -> residual add, every norm Gemma's (x / rms(x) *
(1 + w) in float32, rounded once: GemmaRMSNorm, which holds 1 + w). Around the layers: the
embedding is scaled by sqrt(hidden) rounded to the model dtype (as transformers does; bf16 makes
sqrt(3072) 55.5), the embedding is tied to lm_head, and Gemma 2 soft-caps the final logits
(cap * tanh(logits / cap)). In attention: the scale is query_pre_attn_scalar ** -0.5 (the
backend's, from ArchConfig.attention_scale), sliding-window layers alternate with global ones and
Gemma 2 soft-caps the attention logits (each layer's AttentionLayerSpec, which the backend
honours or refuses at load), Gemma 3 norms q and k (GemmaRMSNorm over head_dim) and gives its
sliding layers their own RoPE table (rope_local_base_freq).

As in llama.py the residual adds are deferred into the next norm's launch: the post-attention and
post-feed-forward norms' outputs are the `pending` tensors. What does not fit Gemma stays off
through what the layers declare: GemmaDecoderLayer has no deferred-norm path, so it folds no norm
weights (fold_norm_weights returns False). Gemma 3's Q/K norms go into the decode attention
launch with RoPE where the backend applies them (CausalLM.fuse_decode_rope, as for Qwen3).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from tokenmill.config import KernelConfig
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.attention import SelfAttention
from tokenmill.model.layers.layer_ops import LayerOps, RopeInputs
from tokenmill.model.layers.linear import bind_hot_path
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.layers.mlp import GeGLUMLP
from tokenmill.model.layers.rmsnorm import GemmaRMSNorm
from tokenmill.model.layers.rotary import RotaryEmbedding
from tokenmill.model.llama import CausalLM

logger = logging.getLogger(__name__)

# A Gemma3ForConditionalGeneration checkpoint: its text model's weights under these prefixes
# (transformers 5 writes the first, earlier versions the others), and the vision parts we skip.
_TEXT_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.",
)  # fmt: skip
_EXTRA_LAYER_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        attn_backend: AttentionBackend,
        ops: LayerOps,
        *,
        layer_spec: AttentionLayerSpec,
        uses_local_rope: bool,
        linear_method: LinearMethod | None = None,
        device=None,
        dtype: torch.dtype | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """`tp_rank` of `tp_size`: the shard of the attention heads and MLP columns this layer
        holds (o_proj and down_proj all-reduce, so the norms around them see whole rows)."""
        super().__init__()
        eps = arch.rms_norm_eps
        place = {"device": device, "dtype": dtype}
        shard = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, eps, device)
        self.self_attn = SelfAttention(
            arch, attn_backend, ops, linear_method=linear_method, layer_spec=layer_spec,
            qk_norm_class=GemmaRMSNorm, **shard, **place,
        )  # fmt: skip
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, eps, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps, device)
        self.mlp = GeGLUMLP(
            arch.hidden_size, arch.intermediate_size, ops, linear_method=linear_method, **shard, **place
        )
        self.post_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps, device)
        self.ops = ops
        self.eps = eps
        # Gemma 3's sliding-window layers rotate with their own table (GemmaCausalLM.forward).
        self.uses_local_rope = uses_local_rope
        self.norms_folded = False  # never: see fold_norm_weights
        bind_hot_path(
            self, attn=self.self_attn, mlp=self.mlp, input_norm=self.input_layernorm.weight,
            post_attn_norm=self.post_attention_layernorm.weight,
            pre_ff_norm=self.pre_feedforward_layernorm.weight,
            post_ff_norm=self.post_feedforward_layernorm.weight,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] residual stream
        pending: torch.Tensor | None,  # the previous layer's normed MLP output, not yet added to x
        rope: RopeInputs,  # this layer's table (Gemma 3: local or global)
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        fuse_rope: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the residual stream (x, updated in place) and this layer's post-feed-forward-normed
        MLP output, which the caller adds to it inside the next norm."""
        ops, eps = self.ops, self.eps
        normed = ops.add_rms_norm(x, self._input_norm, eps, pending, weight_in_float32=True)
        attn_out = self._attn(normed, rope, kv_cache, meta, fuse_rope)
        attn_out = ops.add_rms_norm(attn_out, self._post_attn_norm, eps, None, weight_in_float32=True)
        normed = ops.add_rms_norm(x, self._pre_ff_norm, eps, attn_out, weight_in_float32=True)
        mlp_out = self._mlp(normed)
        return x, ops.add_rms_norm(mlp_out, self._post_ff_norm, eps, None, weight_in_float32=True)

    def fold_norm_weights(self) -> bool:
        """The deferred-norm path (llama.DecoderLayer) folds the input and post-attention norms into
        the next matmuls and adds the residual in o_proj's epilogue; Gemma's post-attention norm
        sits between o_proj and that add, and its norms scale by 1 + w in float32, so it has no
        such path and folds nothing."""
        return False


class GemmaCausalLM(CausalLM):
    supports_piecewise_graphs = True  # its forward has no host logic on the data (checked on a GPU)
    # Sharded as llama's: heads and GeGLU columns per rank, the vocabulary-parallel embedding
    # (scaled after its all-reduce) and lm_head (soft-capped after its all-gather).
    supports_tensor_parallel = True

    def __init__(
        self,
        arch: ArchConfig,
        attn_backend: AttentionBackend,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_positions: int | None = None,
        kernel: KernelConfig | None = None,
        linear_method: LinearMethod | None = None,
    ) -> None:
        super().__init__(
            arch, attn_backend, device=device, dtype=dtype, max_positions=max_positions, kernel=kernel,
            linear_method=linear_method,
        )  # fmt: skip
        dtype = dtype or torch.float32
        # The final norm's 1 + w, in float32 like every GemmaRMSNorm weight.
        self.norm = nn.Parameter(
            torch.ones(arch.hidden_size, device=device, dtype=torch.float32), requires_grad=False
        )
        # transformers multiplies by sqrt(hidden) cast to the embedding's dtype first.
        self.register_buffer(
            "embed_scale", torch.tensor(arch.hidden_size**0.5, device=device).to(dtype), persistent=False
        )
        self.local_rotary = None
        if arch.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(
                arch.head_dim, self.max_positions, arch.local_rope_theta, arch.local_rope_scaling,
                device=device, dtype=dtype,
            )  # fmt: skip
        self.num_skipped_vision_weights = 0

    def _make_layer(
        self,
        index: int,
        kernel: KernelConfig,
        linear_method: LinearMethod | None,
        device: torch.device | str | None,
        dtype: torch.dtype,
    ) -> nn.Module:
        arch = self.arch
        window = arch.layer_sliding_window(index)
        # A window covering every position this instance can reach never takes effect: the layer
        # attends plainly (still a sliding layer for its RoPE table).
        effective_window = window if window is not None and window < self.max_positions else None
        spec = AttentionLayerSpec(sliding_window=effective_window, logits_soft_cap=arch.attn_logit_softcap)
        return GemmaDecoderLayer(
            arch, self.attn_backend, self.ops, layer_spec=spec,
            uses_local_rope=window is not None and arch.local_rope_theta is not None,
            linear_method=linear_method, device=device, dtype=dtype, tp_rank=self.tp_rank,
            tp_size=self.tp_size,
        )  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden], ready for compute_logits."""
        ops = self.ops
        # This rank's rows of the table, all-reduced into whole ones (one rank: a plain lookup).
        x = self.vocab_shard.embed(input_ids, self.embed_tokens).mul_(self.embed_scale)
        rope = ops.rope_inputs(self.rotary, positions)
        local_rope = rope if self.local_rotary is None else ops.rope_inputs(self.local_rotary, positions)
        fuse_rope = self.fuse_decode_rope and self.attn_backend.supports_fused_decode_rope(meta)
        pending = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer_rope = local_rope if layer.uses_local_rope else rope
            x, pending = layer(x, pending, layer_rope, kv_cache, meta, fuse_rope)
        return ops.add_rms_norm(x, self.norm, self.arch.rms_norm_eps, pending, weight_in_float32=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab], soft-capped where the model says so."""
        logits = self.lm_head(hidden, out_dtype=torch.float32)
        cap = self.arch.final_logit_softcap
        if cap is not None:
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits

    # -- loading ------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """llama's loading, with each norm's w stored as the 1 + w (float32) GemmaRMSNorm applies,
        and a Gemma3ForConditionalGeneration checkpoint's text-model names mapped to Gemma3ForCausalLM's
        (its vision tower and projector are not loaded)."""
        self.num_skipped_vision_weights = 0
        super().load_weights(self._as_text_model_weights(weights, self.embed_tokens.dtype))
        if self.num_skipped_vision_weights:
            skipped = self.num_skipped_vision_weights
            logger.info("loaded the text model only: %d vision weights skipped", skipped)

    def _as_text_model_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if name.startswith(_VISION_PREFIXES):
                self.num_skipped_vision_weights += 1
                continue
            for prefix, replacement in _TEXT_MODEL_PREFIXES:
                if name.startswith(prefix):
                    name = replacement + name.removeprefix(prefix)
                    break
            if name.endswith("norm.weight"):  # every Gemma RMSNorm: input_layernorm ... q_norm, model.norm
                # w in the model's dtype first, as transformers holds it (an fp32 checkpoint run in bf16)
                tensor = 1.0 + tensor.to(dtype).float()
            yield name, tensor

    def _expected_weight_names(self) -> set[str]:
        names = super()._expected_weight_names()
        for i in range(self.arch.num_layers):
            names.update(f"model.layers.{i}.{norm}.weight" for norm in _EXTRA_LAYER_NORMS)
        return names
