"""One plain-PyTorch decoder for the Llama, Mistral, Qwen2 and Qwen3 families.

The families differ only in small switches carried by ArchConfig: q/k/v (and o) bias, Q/K
RMSNorm, tied embeddings, RoPE scaling. The batch is flattened (see attention/backend.py): every
tensor is [num_tokens, ...] and the attention backend reads and writes the paged KV cache.

For speed q/k/v are one matmul and gate/up another (weights concatenated at load), the RoPE
tables are precomputed, and nothing here reads a value back to the host, so a step can be
captured as a CUDA graph.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.linear import (
    drop_plain_copy,
    linear,
    linear_add,
    onednn_packing_available,
    pack_parameter,
    pack_weight,
)
from tokenmill.model.layers.mlp import swiglu_mlp
from tokenmill.model.layers.rmsnorm import rms_norm
from tokenmill.model.layers.rotary import RotaryEmbedding, apply_rotary

logger = logging.getLogger(__name__)

# The CUDA path's fused kernels; imported lazily (triton is optional on CPU-only installs).
_triton_ops = None

# Decode-only steps on the Triton backend rotate q/k and store K/V inside the attention launch
# (TritonPagedBackend.forward_decode_with_rope). TOKENMILL_FUSED_DECODE_ROPE=0 keeps the separate
# RoPE + KV-store launch, for same-run comparisons.
_FUSE_DECODE_ROPE = os.environ.get("TOKENMILL_FUSED_DECODE_ROPE", "1") != "0"
# Those steps also skip both RMSNorm launches of a layer when the norm weights are folded into
# the matmuls (CausalLM.fold_norm_weights): see DecoderLayer._forward_deferred_norm.
# TOKENMILL_DEFERRED_NORM=0 normalizes in launches of their own, for same-run comparisons.
_DEFER_NORM = os.environ.get("TOKENMILL_DEFERRED_NORM", "1") != "0"


# CPU: below this many bytes of matmul weights, keep plain copies beside the oneDNN-packed ones
# (see CausalLM.pack_cpu_matmul_weights): SmolLM2-135M's are 428 MiB.
_KEEP_PLAIN_WEIGHTS_BYTES = 1 << 30


def _fused_ops():
    global _triton_ops
    if _triton_ops is None:
        from tokenmill.kernels.triton import elementwise as triton_ops

        _triton_ops = triton_ops
    return _triton_ops


def _param(shape: tuple[int, ...], device, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, attn_backend: AttentionBackend, device=None, dtype=None) -> None:
        super().__init__()
        self.arch = arch
        self.attn_backend = attn_backend
        hidden, inter = arch.hidden_size, arch.intermediate_size
        qkv_rows = arch.q_size + 2 * arch.kv_size
        self.input_norm = _param((hidden,), device, dtype)
        self.qkv_weight = _param((qkv_rows, hidden), device, dtype)
        self.qkv_bias = _param((qkv_rows,), device, dtype) if arch.attention_bias else None
        self.q_norm = _param((arch.head_dim,), device, dtype) if arch.qk_norm else None
        self.k_norm = _param((arch.head_dim,), device, dtype) if arch.qk_norm else None
        self.o_weight = _param((hidden, arch.q_size), device, dtype)
        self.o_bias = _param((hidden,), device, dtype) if arch.o_proj_bias else None
        self.post_attention_norm = _param((hidden,), device, dtype)
        self.gate_up_weight = _param((2 * inter, hidden), device, dtype)
        self.down_weight = _param((hidden, inter), device, dtype)
        # Set by CausalLM.fold_norm_weights: qkv_weight and gate_up_weight carry the input and
        # post-attention norm weights, and the norms must run without them.
        self.norms_folded = False

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] residual stream, updated in place
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if self.norms_folded:
            raise RuntimeError("this layer's norm weights are folded into its matmuls: use forward_fused")
        arch = self.arch
        eps = arch.rms_norm_eps
        num_tokens = x.shape[0]
        heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = arch.q_size, arch.kv_size

        qkv = linear(rms_norm(x, self.input_norm, eps), self.qkv_weight, self.qkv_bias)
        if self.q_norm is not None:
            q = rms_norm(qkv[:, :q_size].view(num_tokens, heads, head_dim), self.q_norm, eps)
            k = rms_norm(
                qkv[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim), self.k_norm, eps
            )
            q = apply_rotary(q, cos, signed_sin)
            k = apply_rotary(k, cos, signed_sin)
        else:
            # q and k sit side by side in each qkv row: rotate both with one set of ops.
            qk = apply_rotary(
                qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, head_dim), cos, signed_sin
            )
            q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)

        attn = self.attn_backend.forward(q, k, v, kv_cache, meta)
        x.add_(linear(attn.reshape(num_tokens, q_size), self.o_weight, self.o_bias))
        x.add_(swiglu_mlp(rms_norm(x, self.post_attention_norm, eps), self.gate_up_weight, self.down_weight))
        return x

    def forward_fused(
        self,
        x: torch.Tensor,  # [T, hidden] residual stream
        pending: torch.Tensor | None,  # the previous layer's MLP output, not yet added to x
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The CUDA path: same math as forward() in a few fused launches (see kernels/triton/elementwise.py).

        Returns the residual stream (x updated in place, or a new tensor) and this layer's MLP
        output, which the caller adds to it inside the next fused norm (None when the layer added
        it itself: the deferred-norm path).
        """
        ops = _fused_ops()
        eps = self.arch.rms_norm_eps
        num_tokens, q_size = x.shape[0], self.arch.q_size
        # The Triton backend's cache takes the rotated keys and the values from the RoPE launch.
        fuse_store = self.attn_backend.name == "triton"
        fuse_rope = (
            fuse_store
            and self.q_norm is None
            and _FUSE_DECODE_ROPE
            and self.attn_backend.fuses_decode_rope(meta)
        )
        if fuse_rope and self.norms_folded and _DEFER_NORM:
            if pending is not None:
                raise RuntimeError("the deferred-norm path needs the residual stream complete (pending=None)")
            return self._forward_deferred_norm(x, positions, rotary, kv_cache, meta), None

        input_norm = None if self.norms_folded else self.input_norm
        qkv = linear(ops.add_rms_norm(x, input_norm, eps, pending), self.qkv_weight, self.qkv_bias)
        if fuse_rope:
            attn = self._attend_with_rope_in_launch(qkv, positions, rotary, kv_cache, meta)
        else:
            attn = self._rope_and_attend(qkv, positions, rotary, kv_cache, meta, fuse_store)
        attn_out = linear(attn.reshape(num_tokens, q_size), self.o_weight, self.o_bias)
        post_norm = None if self.norms_folded else self.post_attention_norm
        normed = ops.add_rms_norm(x, post_norm, eps, attn_out)
        gate_up = linear(normed, self.gate_up_weight)
        return x, linear(ops.silu_mul(gate_up), self.down_weight)

    def _forward_deferred_norm(
        self,
        x: torch.Tensor,  # [T, hidden] residual stream, complete
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """forward_fused for small decode-only steps of a layer with folded norm weights: no norm
        launches. RMSNorm(h) * w @ W = (h @ (w * W)) / rms(h), so the matmuls read the residual
        rows themselves and the kernels that consume their outputs (the attention launch for
        q/k/v, silu_mul for gate/up) apply 1/rms(h). The residual adds happen in the o_proj and
        down matmuls (`linear_add`), which return the residual stream. Per layer that is 6
        launches instead of 8: at batch 1 an add+RMSNorm launch costs ~2.3 us on an H200, and
        Llama-3.1-8B decodes at 223.2 instead of 218.6 tok/s (benchmarks/BENCHMARKS.md)."""
        ops = _fused_ops()
        eps = self.arch.rms_norm_eps
        num_tokens, q_size = x.shape[0], self.arch.q_size
        qkv = linear(x, self.qkv_weight)  # no bias: fold_norm_weights folds only bias-free models
        attn = self._attend_with_rope_in_launch(qkv, positions, rotary, kv_cache, meta, norm_source=x)
        x = linear_add(x, attn.reshape(num_tokens, q_size), self.o_weight)
        gate_up = linear(x, self.gate_up_weight)
        return linear_add(x, ops.silu_mul(gate_up, norm_source=x, eps=eps), self.down_weight)

    def _attend_with_rope_in_launch(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        norm_source: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Small decode-only steps (CUDA-graph ones): RoPE, the KV store and attention in one
        launch; q and k go in un-rotated. With `norm_source` (the deferred-norm path) qkv is the
        projection of those un-normalized rows and the launch applies their 1/rms too."""
        arch = self.arch
        num_tokens = qkv.shape[0]
        heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = arch.q_size, arch.kv_size
        qk = qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)
        return self.attn_backend.forward_decode_with_rope(
            qk[:, :heads], qk[:, heads:], v, positions, rotary.cos_cache, rotary.sin_cache, kv_cache, meta,
            norm_source=norm_source, norm_eps=arch.rms_norm_eps,
        )  # fmt: skip

    def _rope_and_attend(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        fuse_store: bool,
    ) -> torch.Tensor:
        """forward_fused's RoPE (+ KV store) launch, then the backend's attention."""
        ops = _fused_ops()
        arch = self.arch
        eps = arch.rms_norm_eps
        num_tokens = qkv.shape[0]
        heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = arch.q_size, arch.kv_size
        v = qkv[:, q_size + kv_size :].view(num_tokens, kv_heads, head_dim)
        cos, sin = rotary.cos_cache, rotary.sin_cache
        if self.q_norm is not None:
            q = rms_norm(qkv[:, :q_size].view(num_tokens, heads, head_dim), self.q_norm, eps)
            k = rms_norm(
                qkv[:, q_size : q_size + kv_size].view(num_tokens, kv_heads, head_dim), self.k_norm, eps
            )
            ops.rope_inplace(q, positions, cos, sin)
            if fuse_store:
                ops.rope_and_store_kv(k, 0, v, positions, cos, sin, kv_cache, meta.slot_mapping)
            else:
                ops.rope_inplace(k, positions, cos, sin)
        else:
            qk = qkv[:, : q_size + kv_size].view(num_tokens, heads + kv_heads, head_dim)
            if fuse_store:
                ops.rope_and_store_kv(qk, heads, v, positions, cos, sin, kv_cache, meta.slot_mapping)
            else:
                ops.rope_inplace(qk, positions, cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        return self.attn_backend.forward(q, k, v, kv_cache, meta, kv_already_stored=fuse_store)


class CausalLM(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        attn_backend: AttentionBackend,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        max_positions: int | None = None,
    ) -> None:
        """Parameters are allocated uninitialized on `device` in `dtype`; call load_weights next.

        `max_positions` bounds the RoPE table (defaults to the model's max_position_embeddings).
        """
        super().__init__()
        dtype = dtype or torch.float32
        self.arch = arch
        self.attn_backend = attn_backend
        self.embed_tokens = _param((arch.vocab_size, arch.hidden_size), device, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, attn_backend, device, dtype) for _ in range(arch.num_layers)
        )
        self.norm = _param((arch.hidden_size,), device, dtype)
        if arch.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = _param((arch.vocab_size, arch.hidden_size), device, dtype)
        self._packed_lm_head: torch.Tensor | None = None  # a tied lm_head's oneDNN copy (CPU)
        self.rotary = RotaryEmbedding(
            arch.head_dim,
            max_positions or arch.max_position_embeddings,
            arch.rope_theta,
            arch.rope_scaling,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden], ready for compute_logits."""
        x = F.embedding(input_ids, self.embed_tokens)
        if x.is_cuda:
            pending = None
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                x, pending = layer.forward_fused(x, pending, positions, self.rotary, kv_cache, meta)
            return _fused_ops().add_rms_norm(x, self.norm, self.arch.rms_norm_eps, pending)
        cos, signed_sin = self.rotary(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, signed_sin, kv_cache, meta)
        return rms_norm(x, self.norm, self.arch.rms_norm_eps)

    def fold_norm_weights(self) -> bool:
        """Fold each layer's input and post-attention RMSNorm weights into the qkv and gate_up
        weights (W <- W * w along the input dimension, rounded once), so that a decode step can
        skip the norm launches (DecoderLayer._forward_deferred_norm); the other CUDA paths then
        normalize without a weight. CUDA only. Models with a q/k/v or o_proj bias or Q/K norms
        keep their weights as they are (the deferred path has no place for those); returns
        whether the weights were folded.
        """
        arch = self.arch
        if self.embed_tokens.device.type != "cuda" or arch.qk_norm or arch.attention_bias or arch.o_proj_bias:
            return False
        with torch.no_grad():
            for layer in self.layers:
                if layer.norms_folded:
                    continue
                layer.qkv_weight.mul_(layer.input_norm)
                layer.gate_up_weight.mul_(layer.post_attention_norm)
                layer.norms_folded = True
        return True

    def store_matmul_weights_k_major(self) -> None:
        """Keep each matmul weight's logical [out, in] shape but store it transposed (in-major).

        F.linear then hands cuBLAS a plain row-major [in, out] operand, and at decode batch sizes
        its kernels for that layout read weights faster: on an H200 (BENCHMARKS.md, gemv_microbench,
        batch 1) down_proj 30.0 vs 32.6 us, lm_head 234 vs 255 us, the rest within 2 %. A tied
        lm_head stays as it is: it is also the embedding table, gathered by rows.
        Only with the row GEMV off (layers/linear.py): it reads the out-major layout, and beats
        cuBLAS in either one at the few-row steps where the layout mattered.
        """
        weights = [
            p
            for layer in self.layers
            for p in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)
        ]
        if self.lm_head is not self.embed_tokens:
            weights.append(self.lm_head)
        for weight in weights:
            weight.data = weight.data.t().contiguous().t()

    def pack_cpu_matmul_weights(self, keep_plain_bytes: int = _KEEP_PLAIN_WEIGHTS_BYTES) -> bool:
        """On the CPU, prepack every matmul weight for oneDNN (see layers/linear.py).

        Packed weights take the parameters' place (same memory). While the matmul weights total
        at most `keep_plain_bytes`, their plain originals stay too, for single-row steps (one
        request decoding), where oneDNN's per-call cost loses to MKL; larger models give that up
        rather than double their weight memory. A tied lm_head gets a packed copy (its plain
        form is the embedding table, kept anyway). Returns False where oneDNN packing is not
        available for this dtype, leaving the weights as they are.
        """
        if self.embed_tokens.device.type != "cpu" or not onednn_packing_available(self.embed_tokens.dtype):
            return False
        names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
        tied = self.lm_head is self.embed_tokens
        matmul_bytes = sum(getattr(layer, name).nbytes for layer in self.layers for name in names)
        matmul_bytes += 0 if tied else self.lm_head.nbytes
        keep_plain = matmul_bytes <= keep_plain_bytes
        for layer in self.layers:
            for name in names:
                pack_parameter(layer, name, keep_plain=keep_plain)
        if tied:
            self._packed_lm_head = pack_weight(self.lm_head, keep_plain=True)  # no copy: the table itself
        else:
            pack_parameter(self, "lm_head", keep_plain=keep_plain)
        logger.info(
            "CPU matmul weights prepacked for oneDNN (%.0f MiB)%s",
            matmul_bytes / 2**20,
            "; plain copies kept for single-row steps" if keep_plain else "",
        )
        return True

    def attach_quantized_weights(self, quantized: Iterable[tuple[str, int, np.ndarray]]) -> int:
        """Keep GGUF blocks (loader.gguf_loader.iter_gguf_quantized) beside the matmul weights for
        steps of a few rows (layers/quantized_linear.py). A fused weight (qkv, gate_up) gets blocks only
        when all its parts come in the same type. Returns the bytes attached."""
        from tokenmill.model.layers.quantized_linear import QuantizedBlocks, attach, split_rows

        by_name = {name: (code, rows) for name, code, rows in quantized}
        arch = self.arch
        attached = 0

        def blocks_for(names: list[str], out_features: int) -> QuantizedBlocks | None:
            parts = [by_name[name] for name in names if name in by_name]
            if len(parts) != len(names) or len({code for code, _ in parts}) != 1:
                return None
            code = parts[0][0]
            rows = split_rows(np.concatenate([rows for _, rows in parts]), code)  # a copy, off the mmap
            if rows.shape[0] != out_features:
                return None
            return QuantizedBlocks(torch.from_numpy(rows), code, out_features)

        fused = {
            "qkv_weight": (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], arch.q_size + 2 * arch.kv_size),
            "o_weight": (["self_attn.o_proj"], arch.hidden_size),
            "gate_up_weight": (["mlp.gate_proj", "mlp.up_proj"], 2 * arch.intermediate_size),
            "down_weight": (["mlp.down_proj"], arch.hidden_size),
        }  # fmt: skip
        targets: list[tuple[torch.Tensor, QuantizedBlocks | None]] = [
            (
                getattr(layer, attr),
                blocks_for([f"model.layers.{i}.{part}.weight" for part in parts], out_features),
            )
            for i, layer in enumerate(self.layers)
            for attr, (parts, out_features) in fused.items()
        ]
        lm_head_name = "model.embed_tokens.weight" if self.lm_head is self.embed_tokens else "lm_head.weight"
        lm_head = self._packed_lm_head if self._packed_lm_head is not None else self.lm_head
        targets.append((lm_head, blocks_for([lm_head_name], arch.vocab_size)))
        for weight, blocks in targets:
            if blocks is not None:
                attach(weight, blocks)
                drop_plain_copy(weight)  # the blocks serve its one-row steps now
                attached += blocks.blocks.nbytes
        return attached

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        head = self._packed_lm_head if self._packed_lm_head is not None else self.lm_head
        return linear(hidden, head, out_dtype=torch.float32)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters, converting device and dtype.

        Raises ValueError on an unknown name, a shape mismatch, or a parameter left unloaded.
        """
        expected = self._expected_weight_names()
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._target_for(name)
            if target is None:
                continue
            if target.shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: shape {tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
                )
            target.copy_(tensor)  # converts dtype and device
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing weights: {shown}")

    def _expected_weight_names(self) -> set[str]:
        arch = self.arch
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not arch.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(arch.num_layers):
            prefix = f"model.layers.{i}."
            names.update(prefix + n for n in _LAYER_WEIGHTS)
            if arch.attention_bias:
                names.update(prefix + f"self_attn.{p}_proj.bias" for p in "qkv")
            if arch.o_proj_bias:
                names.add(prefix + "self_attn.o_proj.bias")
            if arch.qk_norm:
                names.update((prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"))
        return names

    def _target_for(self, name: str) -> torch.Tensor | None:
        """The parameter slice an HF tensor goes into; None for tensors we deliberately ignore."""
        if name == "model.embed_tokens.weight":
            return self.embed_tokens.data
        if name == "model.norm.weight":
            return self.norm.data
        if name == "lm_head.weight":
            # A tied checkpoint may still ship a copy of the embedding; the embedding wins.
            return None if self.arch.tie_word_embeddings else self.lm_head.data
        if name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed from the config
        match = _LAYER_NAME.fullmatch(name)
        if match is None or int(match["layer"]) >= len(self.layers):
            raise ValueError(f"unexpected weight {name!r} for a {self.arch.architecture} model")
        layer: DecoderLayer = self.layers[int(match["layer"])]  # type: ignore[assignment]
        arch = self.arch
        part = match["part"]
        q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
        fused_rows = {
            "self_attn.q_proj": (0, q),
            "self_attn.k_proj": (q, q + kv),
            "self_attn.v_proj": (q + kv, q + 2 * kv),
            "mlp.gate_proj": (0, inter),
            "mlp.up_proj": (inter, 2 * inter),
        }
        module, kind = part.rsplit(".", 1)
        if module in fused_rows:
            start, end = fused_rows[module]
            if module.startswith("mlp."):
                fused = layer.gate_up_weight if kind == "weight" else None
            else:
                fused = layer.qkv_weight if kind == "weight" else layer.qkv_bias
            if fused is None:
                raise ValueError(
                    f"unexpected weight {name!r}: this {arch.architecture} model has no such bias"
                )
            return fused.data[start:end]
        single = {
            "input_layernorm.weight": layer.input_norm,
            "post_attention_layernorm.weight": layer.post_attention_norm,
            "self_attn.o_proj.weight": layer.o_weight,
            "self_attn.o_proj.bias": layer.o_bias,
            "self_attn.q_norm.weight": layer.q_norm,
            "self_attn.k_norm.weight": layer.k_norm,
            "mlp.down_proj.weight": layer.down_weight,
        }
        param = single.get(part)
        if param is None:
            raise ValueError(f"unexpected weight {name!r} for a {arch.architecture} model")
        return param.data


_LAYER_NAME = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<part>.+)")
_LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
