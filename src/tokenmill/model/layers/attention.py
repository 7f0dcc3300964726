"""The self-attention block: the q/k/v projection, optional Q/K RMSNorm, RoPE, the attention
backend over the paged KV cache, and the output projection.

Which launches a step takes is decided by what the backend and the ops declare, not by device or
backend names: ops that can store K/V in the RoPE launch do so when the backend accepts K/V
stored that way (`accepts_kv_stored_by_rope`); a backend that supports it for this step
(`supports_fused_decode_rope(meta)`) does RoPE, the KV store and attention in one launch.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from tokenmill.attention.backend import (
    PLAIN_ATTENTION,
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
    QKNorm,
)
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.layer_ops import LayerOps, RopeInputs
from tokenmill.model.layers.linear import QKVParallelLinear, RowParallelLinear, bind_hot_path
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.layers.rmsnorm import GemmaRMSNorm, RMSNorm


class SelfAttention(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        attn_backend: AttentionBackend,
        ops: LayerOps,
        *,
        linear_method: LinearMethod | None = None,
        layer_spec: AttentionLayerSpec = PLAIN_ATTENTION,
        qk_norm_class: type[RMSNorm] | type[GemmaRMSNorm] = RMSNorm,
        tp_rank: int = 0,
        tp_size: int = 1,
        device=None,
        dtype: torch.dtype | None = None,
        qkv_input_size: int | None = None,
    ) -> None:
        """`qkv_input_size`: the width q/k/v are projected from when it is not the hidden size (an
        EAGLE-3 drafter's layer reads [embedding, hidden] side by side: 2 x hidden)."""
        super().__init__()
        shard = {
            "method": linear_method,
            "tp_rank": tp_rank,
            "tp_size": tp_size,
            "device": device,
            "dtype": dtype,
        }
        self.qkv_proj = QKVParallelLinear(
            qkv_input_size or arch.hidden_size,
            arch.head_dim,
            arch.num_heads,
            arch.num_kv_heads,
            bias=arch.attention_bias,
            **shard,
        )
        eps = arch.rms_norm_eps
        # Q/K norms over head_dim (Qwen3: RMSNorm; Gemma 3: GemmaRMSNorm), applied before RoPE.
        self.q_norm = qk_norm_class(arch.head_dim, eps, device, dtype) if arch.qk_norm else None
        self.k_norm = qk_norm_class(arch.head_dim, eps, device, dtype) if arch.qk_norm else None
        self.o_proj = RowParallelLinear(arch.q_size, arch.hidden_size, bias=arch.o_proj_bias, **shard)
        self.attn_backend = attn_backend
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        # The FP8 KV cache's scales (kernels/kv_fp8.py), one per KV head of this rank, named where
        # checkpoints keep them (model.layers.N.self_attn.k_scale / v_scale); read only when the
        # cache is FP8. set_kv_scales fills them in place: the layer spec holds these tensors.
        self.register_buffer("k_scale", torch.ones(self.num_kv_heads, dtype=torch.float32, device=device))
        self.register_buffer("v_scale", torch.ones(self.num_kv_heads, dtype=torch.float32, device=device))
        # This layer's sliding window / soft cap / sinks and KV scales, passed to the backend with every call.
        self.layer_spec = replace(layer_spec, k_scale=self.k_scale, v_scale=self.v_scale)
        # The KV cache group whose block tables this layer reads and writes (core/kv_cache_groups.py);
        # the model runner sets it after load. 0 for every layer of a model without sliding layers.
        self.kv_group = 0
        # This layer's index in the model's per-layer cache list, for a KV connector's per-layer
        # hooks (meta.kv_layer_hooks); the model runner sets it after load (-1: not set).
        self.layer_index = -1
        self.ops = ops
        self.eps = eps
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = self.num_heads * arch.head_dim, self.num_kv_heads * arch.head_dim
        # The backend's cache takes the rotated keys and the values from the RoPE launch.
        self.store_kv_in_rope = ops.stores_kv_in_rope and attn_backend.accepts_kv_stored_by_rope
        bind_hot_path(self, qkv=self.qkv_proj, o=self.o_proj)

    @torch.no_grad()
    def set_kv_scales(self, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
        """The FP8 KV cache's scales of this layer: per tensor (a number, or a tensor of one
        element, as checkpoints store k_scale / v_scale) or per KV head ([num_kv_heads] of this
        rank). Copied into the k_scale / v_scale buffers in place, both checked before either changes."""
        k, v = self._checked_kv_scale("k_scale", k_scale), self._checked_kv_scale("v_scale", v_scale)
        self.k_scale.copy_(k)
        self.v_scale.copy_(v)

    @torch.no_grad()
    def load_kv_scale(self, name: str, value: torch.Tensor) -> None:
        """One of the checkpoint's KV scales ("k_scale" or "v_scale"), as set_kv_scales takes it."""
        if name not in ("k_scale", "v_scale"):
            raise ValueError(f"no such KV scale {name!r}; expected k_scale or v_scale")
        getattr(self, name).copy_(self._checked_kv_scale(name, value))

    def _checked_kv_scale(self, name: str, value: torch.Tensor | float) -> torch.Tensor:
        scale = torch.as_tensor(value, dtype=torch.float32).detach().to("cpu").reshape(-1)
        if scale.numel() not in (1, self.num_kv_heads):
            raise ValueError(
                f"{name} has {scale.numel()} values; expected 1 (per tensor) or {self.num_kv_heads} "
                "(one per KV head of this layer)"
            )
        if not (torch.isfinite(scale).all() and (scale > 0).all()):
            raise ValueError(f"{name} must be positive and finite, got {scale.tolist()}")
        return scale.expand(self.num_kv_heads)

    def forward(
        self,
        normed: torch.Tensor,  # [T, hidden], the input RMSNorm's output
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        fuse_rope: bool,  # this step goes through the backend's forward_decode_with_rope
    ) -> torch.Tensor:
        """o_proj(attention(...)) [T, hidden], not yet added to the residual stream."""
        qkv = self._qkv(normed)
        if fuse_rope:
            attn = self.attend_with_rope_in_launch(qkv, rope, kv_cache, meta)
        else:
            attn = self.rope_and_attend(qkv, rope, kv_cache, meta)
        return self._o(attn.reshape(qkv.shape[0], self.q_size))

    # Called once per layer per step: skip nn.Module.__call__'s hook dispatch (see LinearBase.__call__).
    __call__ = forward

    def _qk_norm(self) -> QKNorm | None:
        """The per-head Q/K norms (Qwen3, Gemma 3) for a launch that applies them; None without.
        Built per call: loading or folding may replace the norm weights."""
        if self.q_norm is None:
            return None
        return QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)

    def attend_with_rope_in_launch(
        self,
        qkv: torch.Tensor,
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        norm_source: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Small decode-only steps (CUDA-graph ones): RoPE, the KV store and attention in one
        launch; q and k go in un-rotated (and un-normalized: a model with Q/K norms fuses only on
        backends whose fused_decode_rope_applies_qk_norm says they apply them). `meta` is the
        step's (group 0's): the layer picks its KV cache group's, here and in rope_and_attend. With
        `norm_source` (the deferred-norm path) qkv is the projection of those un-normalized rows
        and the launch applies their 1/rms too."""
        hooks = meta.kv_layer_hooks
        if hooks is not None:
            hooks.wait_for_layer_load(self.layer_index)
        if self.kv_group:
            meta = meta.kv_group_siblings[self.kv_group - 1]
        num_tokens = qkv.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = self.q_size, self.kv_size
        qk = qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)
        qk_norm = self._qk_norm()
        out = self.attn_backend.forward_decode_with_rope(
            qk[:, :heads], qk[:, heads:], v, rope.positions, rope.cos_cache, rope.sin_cache, kv_cache, meta,
            norm_source=norm_source, norm_eps=self.eps, qk_norm=qk_norm, layer=self.layer_spec,
        )  # fmt: skip
        if hooks is not None:
            hooks.save_kv_layer(self.layer_index)
        return out

    def rope_and_attend(
        self, qkv: torch.Tensor, rope: RopeInputs, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Q/K norm and RoPE (with the KV store where the ops and backend allow), then the
        backend's attention. A KV connector's hooks (meta.kv_layer_hooks) run before the store and
        after the attention."""
        hooks = meta.kv_layer_hooks
        if hooks is not None:
            hooks.wait_for_layer_load(self.layer_index)
        if self.kv_group:  # (inlined for_kv_group: one integer test per layer for one-group models)
            meta = meta.kv_group_siblings[self.kv_group - 1]
        ops = self.ops
        num_tokens = qkv.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_size, kv_size = self.q_size, self.kv_size
        store = self.store_kv_in_rope
        v = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)
        if self.q_norm is not None and ops.applies_qk_norm_in_rope:
            # The Q/K norms, RoPE (and the store) in one launch, in place on qkv's q and k.
            qk = qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, head_dim)
            qk_norm = self._qk_norm()
            if store:
                qk = ops.rotate_and_store_kv(
                    qk, heads, v, rope, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale, qk_norm=qk_norm
                )
            else:
                qk = ops.rotate(qk, rope, qk_norm=qk_norm, num_q_heads=heads)
            q, k = qk[:, :heads], qk[:, heads:]
        elif self.q_norm is not None:
            q = self.q_norm.forward(qkv[:, :q_size].view(num_tokens, heads, head_dim))
            k = self.k_norm.forward(qkv[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim))
            q = ops.rotate(q, rope)
            if store:
                k = ops.rotate_and_store_kv(
                    k, 0, v, rope, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale
                )
            else:
                k = ops.rotate(k, rope)
        else:
            # q and k sit side by side in each qkv row: rotate both with one set of ops.
            qk = qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, head_dim)
            if store:
                qk = ops.rotate_and_store_kv(
                    qk, heads, v, rope, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale
                )
            else:
                qk = ops.rotate(qk, rope)
            q, k = qk[:, :heads], qk[:, heads:]
        out = self.attn_backend.forward(q, k, v, kv_cache, meta, kv_already_stored=store, layer=self.layer_spec)
        if hooks is not None:
            hooks.save_kv_layer(self.layer_index)
        return out
