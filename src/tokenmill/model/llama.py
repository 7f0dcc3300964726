"""One decoder for the Llama, Mistral, Qwen2 and Qwen3 families.

The families differ only in small switches carried by ArchConfig: q/k/v (and o) bias, Q/K
RMSNorm, tied embeddings, RoPE scaling. The batch is flattened (see attention/backend.py): every
tensor is [num_tokens, ...] and the attention backend reads and writes the paged KV cache.

For speed q/k/v are one matmul and gate/up another (merged linear layers, loaded shard by shard),
the RoPE tables are precomputed, and nothing here reads a value back to the host, so a step can
be captured as a CUDA graph. There is one forward path: the device's ops (layers/layer_ops.py),
the linear layers' methods (layers/linear_method.py) and what the attention backend declares it
supports pick the launches.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import (
    PLAIN_ATTENTION,
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
)
from tokenmill.config import KernelConfig
from tokenmill.distributed import parallel_state
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.attention import SelfAttention
from tokenmill.model.layers.layer_ops import LayerOps, RopeInputs, select_layer_ops
from tokenmill.model.layers.linear import (
    LinearBase,
    QKVParallelLinear,
    ReplicatedLinear,
    ShardId,
    bind_hot_path,
)
from tokenmill.model.layers.linear_method import LinearMethod
from tokenmill.model.layers.mlp import SwiGLUMLP
from tokenmill.model.layers.rmsnorm import RMSNorm
from tokenmill.model.layers.rotary import RotaryEmbedding, partial_rotary_permutation
from tokenmill.model.layers.vocab_parallel import ParallelLMHead, VocabShard


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ArchConfig,
        attn_backend: AttentionBackend,
        ops: LayerOps,
        kernel: KernelConfig,
        *,
        linear_method: LinearMethod | None = None,
        layer_spec: AttentionLayerSpec = PLAIN_ATTENTION,
        device=None,
        dtype: torch.dtype | None = None,
        mlp: nn.Module | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """`mlp` replaces the dense SwiGLU MLP (a mixture-of-experts block: model/moe_models.py).
        `tp_rank` of `tp_size`: the shard of the attention heads and MLP columns this layer holds."""
        super().__init__()
        eps = arch.rms_norm_eps
        place = {"device": device, "dtype": dtype}
        shard = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, **place)
        self.self_attn = SelfAttention(
            arch, attn_backend, ops, linear_method=linear_method, layer_spec=layer_spec, **shard, **place
        )
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, **place)
        if mlp is None:
            mlp = SwiGLUMLP(
                arch.hidden_size, arch.intermediate_size, ops, linear_method=linear_method, **shard, **place
            )
        self.mlp = mlp
        self.ops = ops
        self.eps = eps
        # Steps that fuse RoPE into attention may also skip the norm launches (_forward_deferred_norm)
        # where the backend's fused launch can apply the input norm's 1/rms.
        self.defer_norm = kernel.deferred_norm and attn_backend.fused_decode_rope_applies_norm
        # Set by fold_norm_weights: qkv_proj and gate_up_proj carry the input and post-attention
        # norm weights, and the norms must run without them.
        self.norms_folded = False
        bind_hot_path(
            self, attn=self.self_attn, mlp=self.mlp, input_norm=self.input_layernorm.weight,
            post_norm=self.post_attention_layernorm.weight,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden] residual stream
        pending: torch.Tensor | None,  # the previous layer's MLP output, not yet added to x
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        fuse_rope: bool,  # this step goes through the backend's forward_decode_with_rope
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the residual stream (x updated in place, or a new tensor) and this layer's MLP
        output, which the caller adds to it inside the next norm (None when the layer added it
        itself: the deferred-norm path)."""
        if fuse_rope and self.norms_folded and self.defer_norm:
            if pending is not None:
                raise RuntimeError("the deferred-norm path needs the residual stream complete (pending=None)")
            return self._forward_deferred_norm(x, rope, kv_cache, meta), None
        ops, eps, folded = self.ops, self.eps, self.norms_folded
        normed = ops.add_rms_norm(x, None if folded else self._input_norm, eps, pending)
        attn_out = self._attn(normed, rope, kv_cache, meta, fuse_rope)
        return x, self._mlp(ops.add_rms_norm(x, None if folded else self._post_norm, eps, attn_out))

    def _forward_deferred_norm(
        self,
        x: torch.Tensor,  # [T, hidden] residual stream, complete
        rope: RopeInputs,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """forward for small decode-only steps of a layer with folded norm weights: no norm
        launches. RMSNorm(h) * w @ W = (h @ (w * W)) / rms(h), so the matmuls read the residual
        rows themselves and the kernels that consume their outputs (the attention launch for
        q/k/v; the MLP's, see its forward_from_residual) apply 1/rms(h).
        The residual adds happen in the o_proj and MLP-output epilogues, which return the residual
        stream. Per layer that is 6 launches instead of 8: at batch 1 an add+RMSNorm launch costs
        ~2.3 us on an H200, and Llama-3.1-8B decodes at 223.2 instead of 218.6 tok/s
        (benchmarks/BENCHMARKS.md)."""
        attn = self.self_attn
        qkv = attn.qkv_proj(x)  # no bias: fold_norm_weights folds only bias-free models
        out = attn.attend_with_rope_in_launch(qkv, rope, kv_cache, meta, norm_source=x)
        x = attn.o_proj(out.reshape(x.shape[0], attn.q_size), residual=x)
        return self.mlp.forward_from_residual(x, self.eps)

    def fold_norm_weights(self) -> bool:
        """Fold the input and post-attention RMSNorm weights into qkv_proj and the MLP (W <- W * w
        along the input dimension, rounded once; a dense MLP's gate_up_proj, a MoE block's router
        and experts), so that a decode step can skip the norm launches (_forward_deferred_norm);
        the other paths then normalize without a weight. Only where the linear methods (and the
        MLP) can (CUDA), and not for models with a q/k/v or o_proj bias or Q/K norms. Returns
        whether it folded.

        Q/K norms: the attention launch can apply them after its 1/rms (tested on the CPU and in
        fp32 on an H200, where greedy tokens equal transformers'), but folded, the tiny Qwen3 and
        Qwen3-MoE checkpoints missed their bf16 logprob bounds on an H200: every token still
        agreed, but the dense one's mean logprob difference was 0.0175-0.0239 a prompt against
        0.0097-0.0182 unfolded (bound: 0.02). A precision cost, so those models keep their norm
        launches (Qwen3-30B-A3B shapes: 365.1 tok/s folded, 351.3 with the launches)."""
        attn, mlp = self.self_attn, self.mlp
        can_fold_mlp = getattr(mlp, "can_fold_input_scale", None)
        if (
            attn.q_norm is not None
            # Sharded layers: the row-parallel epilogue adds the residual on rank 0 only and
            # all-reduces after it, and nothing on a GPU is checked with that yet.
            or attn.o_proj.tp_size > 1
            or attn.qkv_proj.bias is not None
            or attn.o_proj.bias is not None
            or not attn.qkv_proj.method.folds_input_scale
            or can_fold_mlp is None
            or not can_fold_mlp()
        ):
            return False
        if not self.norms_folded:
            attn.qkv_proj.fold_input_scale(self.input_layernorm.weight)
            mlp.fold_input_scale(self.post_attention_layernorm.weight)
            self.norms_folded = True
        return True


class CausalLM(nn.Module):
    # Whether the forward can be captured in CUDA graphs between attention calls for any token
    # count (worker/piecewise_graphs.py): no host logic that depends on the data. A family whose
    # forward has some, or that is not checked yet, sets False.
    supports_piecewise_graphs = True
    # Whether the family is built from the sharded layers throughout (model/tensor_parallel.py); a
    # family with its own layers or MLP sets False until they are sharded.
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
        """Parameters are allocated uninitialized on `device` in `dtype`; call load_weights next
        (registry.load_model does, then processes the weights for `linear_method`).

        `max_positions` bounds the RoPE table (defaults to the model's max_position_embeddings).
        """
        super().__init__()
        dtype = dtype or torch.float32
        kernel = kernel or KernelConfig()
        self.kernel = kernel  # the kernel paths, for the hooks that build layers (make_mlp)
        self.arch = arch
        self.attn_backend = attn_backend
        self.ops = select_layer_ops(device or "cpu")
        self.max_positions = max_positions or arch.max_position_embeddings  # positions < this
        # This process's tensor-parallel rank (0 of 1 outside a tensor-parallel worker).
        self.tp_rank, self.tp_size = parallel_state.tp_rank(), parallel_state.tp_size()
        if self.tp_size > 1 and not type(self).supports_tensor_parallel:
            raise ValueError(f"{type(self).__name__} is not sharded for tensor parallelism")
        # The embedding table holds this rank's rows of the vocabulary (all of them on one rank).
        self.vocab_shard = VocabShard(arch.vocab_size, self.tp_rank, self.tp_size)
        self.embed_tokens = nn.Parameter(
            torch.empty((self.vocab_shard.rows, arch.hidden_size), device=device, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(
            self._make_layer(i, kernel, linear_method, device, dtype) for i in range(arch.num_layers)
        )
        self.norm = nn.Parameter(
            torch.empty(arch.hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        tied = self.embed_tokens if arch.tie_word_embeddings else None
        if self.tp_size == 1:
            self.lm_head = ReplicatedLinear(
                arch.hidden_size, arch.vocab_size, method=linear_method, device=device, dtype=dtype,
                shared_weight=tied,
            )  # fmt: skip
        else:
            self.lm_head = ParallelLMHead(
                arch.hidden_size, self.vocab_shard, method=linear_method, device=device, dtype=dtype,
                shared_weight=tied,
            )  # fmt: skip
        self.rotary = RotaryEmbedding(
            arch.head_dim,
            self.max_positions,
            arch.rope_theta,
            arch.rope_scaling,
            device=device,
            dtype=dtype,
            rotary_dim=arch.rotary_dim,
        )
        # Partial rotary: the order our q/k head dimensions take from the checkpoint's (None = as is).
        self.qk_dim_order = (
            None if arch.rotary_dim is None else partial_rotary_permutation(arch.head_dim, arch.rotary_dim)
        )
        # Decode-only steps the backend supports rotate q/k and store K/V inside the attention
        # launch; with Q/K norms (between the projection and RoPE) only where the launch applies them.
        # The layer ops may run a decode step's layers in one call (layer_ops.fused_decode_layers).
        self.fuse_decode_layers = kernel.fused_decode_layers
        self.fuse_decode_rope = kernel.fused_decode_rope and (
            not arch.qk_norm or attn_backend.fused_decode_rope_applies_qk_norm
        )

    def _make_layer(
        self,
        index: int,
        kernel: KernelConfig,
        linear_method: LinearMethod | None,
        device: torch.device | str | None,
        dtype: torch.dtype,
    ) -> nn.Module:
        """Decoder layer `index`; a family whose layers differ (model/gemma.py) overrides this."""
        return DecoderLayer(
            self.arch, self.attn_backend, self.ops, kernel, linear_method=linear_method,
            layer_spec=AttentionLayerSpec(sliding_window=self.arch.layer_sliding_window(index)),
            device=device, dtype=dtype, mlp=self.make_mlp(index, linear_method, device, dtype),
            tp_rank=self.tp_rank, tp_size=self.tp_size,
        )  # fmt: skip

    def make_mlp(
        self, layer: int, linear_method: LinearMethod | None, device, dtype: torch.dtype
    ) -> nn.Module | None:
        """The MLP of decoder layer `layer`, or None for the dense SwiGLU MLP (the hook a family with
        another MLP, such as a mixture of experts, overrides)."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden], ready for compute_logits."""
        if self.tp_size == 1:
            x = F.embedding(input_ids, self.embed_tokens)
        else:
            x = self.vocab_shard.embed(input_ids, self.embed_tokens)
        rope = self.ops.rope_inputs(self.rotary, positions)
        fused = self.ops.fused_decode_layers(self, meta, x.shape[0], rope) if self.fuse_decode_layers else None
        if fused is not None:  # the layers below in one native call (the CPU's decode steps)
            x, pending = fused(x, rope, kv_caches, meta)
            return self.ops.add_rms_norm(x, self.norm, self.arch.rms_norm_eps, pending)
        fuse_rope = self.fuse_decode_rope and self.attn_backend.supports_fused_decode_rope(meta)
        pending = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, pending = layer(x, pending, rope, kv_cache, meta, fuse_rope)
        return self.ops.add_rms_norm(x, self.norm, self.arch.rms_norm_eps, pending)

    def forward_with_aux_hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        aux_layers: tuple[int, ...],  # ascending layer indices
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, plus the residual stream entering each layer of `aux_layers` (transformers'
        output_hidden_states[i]; vLLM's aux_hidden_state_layers), concatenated in layer order
        [T, len(aux_layers) * hidden]: the features an EAGLE-3 drafter fuses (model/eagle3.py).

        A method beside forward so that forward, and every step without a drafter, stays as it
        is. CUDA graphs capture it as it is: the concatenated states become the graph's second
        output, in its memory pool (worker/cuda_graphs.py)."""
        if type(self).forward is not CausalLM.forward:
            raise NotImplementedError(f"{type(self).__name__} has its own forward; aux hidden states are not wired")
        if list(aux_layers) != sorted(set(aux_layers)) or not all(0 <= i < len(self.layers) for i in aux_layers):
            raise ValueError(
                f"aux_layers {list(aux_layers)}: expected distinct ascending layer indices in 0 .. {len(self.layers) - 1}"
            )
        x = F.embedding(input_ids, self.embed_tokens)
        rope = self.ops.rope_inputs(self.rotary, positions)
        fuse_rope = self.fuse_decode_rope and self.attn_backend.supports_fused_decode_rope(meta)
        pending = None
        aux: list[torch.Tensor] = []
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if index in aux_layers:
                # A new tensor either way: the layers update x in place.
                aux.append(x.clone() if pending is None else x + pending)
            x, pending = layer(x, pending, rope, kv_cache, meta, fuse_rope)
        return self.ops.add_rms_norm(x, self.norm, self.arch.rms_norm_eps, pending), torch.cat(aux, dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden, out_dtype=torch.float32)

    def fold_norm_weights(self) -> bool:
        """The post-load transform this family declares for the deferred norm (see
        DecoderLayer.fold_norm_weights); returns whether every layer folded."""
        return all([layer.fold_norm_weights() for layer in self.layers])

    # -- loading ------------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our parameters (q/k/v and gate/up into their merged layers),
        converting device and dtype.

        Raises ValueError on an unknown name, a shape mismatch, or a parameter left unloaded.
        """
        expected = self._quantized_weight_names(self._expected_weight_names())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._checkpoint_target(name)
            if target is None:
                continue
            module, param_name, shard_id = target
            try:
                if self.qk_dim_order is not None and isinstance(module, QKVParallelLinear):
                    tensor = self._qk_in_rotary_layout(tensor, shard_id)
                if param_name in _KV_SCALES and isinstance(module, SelfAttention):
                    module.load_kv_scale(param_name, tensor)
                elif module is self and param_name == "embed_tokens":
                    self.vocab_shard.load_rows(self.embed_tokens.data, tensor)  # this rank's rows
                elif hasattr(module, "weight_loader"):  # linear layers, stacked experts: their shard
                    module.weight_loader(param_name, tensor, shard_id)
                else:
                    param = getattr(module, param_name)
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"shape {tuple(tensor.shape)} does not match the model's {tuple(param.shape)}"
                        )
                    param.data.copy_(tensor)  # converts dtype and device
            except ValueError as err:
                raise ValueError(f"weight {name}: {err}") from None
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing weights: {shown}")

    def _qk_in_rotary_layout(self, tensor: torch.Tensor, shard_id: ShardId) -> torch.Tensor:
        """q and k rows (weight or bias) with each head's dimensions in qk_dim_order: partial rotary's
        rotated pairs where our RoPE launches rotate (layers/rotary.py). v, and tensors of the
        wrong size (which the loader then reports), pass unchanged."""
        arch, order = self.arch, self.qk_dim_order
        assert order is not None

        def permuted(rows: torch.Tensor, heads: int) -> torch.Tensor:
            if rows.shape[0] != heads * arch.head_dim:
                return rows
            return rows.unflatten(0, (heads, arch.head_dim))[:, order.to(rows.device)].flatten(0, 1)

        if shard_id == "q":
            return permuted(tensor, arch.num_heads)
        if shard_id == "k":
            return permuted(tensor, arch.num_kv_heads)
        if shard_id is None and tensor.shape[0] == arch.q_size + 2 * arch.kv_size:  # fused q/k/v
            q, k, v = tensor.split((arch.q_size, arch.kv_size, arch.kv_size))
            return torch.cat((permuted(q, arch.num_heads), permuted(k, arch.num_kv_heads), v))
        return tensor

    def rows_in_model_layout(self, rows: torch.Tensor, shard_id: ShardId) -> torch.Tensor:
        """Output rows of the part `shard_id` (a LoRA B's, a GGUF file's quantized blocks), permuted
        as the checkpoint's weight rows were at load (partial rotary's q/k rows)."""
        return rows if self.qk_dim_order is None else self._qk_in_rotary_layout(rows, shard_id)

    def linear_for_weight(self, name: str) -> tuple[LinearBase, ShardId] | None:
        """The linear layer (and shard) an HF weight name feeds, if any; a tied model's embedding
        table feeds lm_head too."""
        if name == "model.embed_tokens.weight" and self.arch.tie_word_embeddings:
            return self.lm_head, None
        target = self._checkpoint_module(name)  # (no parameter check: a processed layer may hold none)
        if target is None or not isinstance(target[0], LinearBase) or target[1] != "weight":
            return None
        return target[0], target[2]

    def _checkpoint_target(self, name: str) -> tuple[nn.Module, str, ShardId] | None:
        """(module, parameter name, shard id) an HF tensor goes into; None for tensors we
        deliberately ignore."""
        target = self._checkpoint_module(name)
        if target is not None and getattr(target[0], target[1], None) is None:
            raise ValueError(
                f"unexpected weight {name!r}: this {self.arch.architecture} model has no such {target[1]}"
            )
        return target

    def _checkpoint_module(self, name: str) -> tuple[nn.Module, str, ShardId] | None:
        if name == "model.embed_tokens.weight":
            return self, "embed_tokens", None
        if name == "model.norm.weight":
            return self, "norm", None
        if name == "lm_head.weight":
            # A tied checkpoint may still ship a copy of the embedding; the embedding wins.
            return None if self.arch.tie_word_embeddings else (self.lm_head, "weight", None)
        if name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed from the config
        arch = self.arch
        match = _LAYER_NAME.fullmatch(name)
        if match is None or int(match["layer"]) >= len(self.layers):
            raise ValueError(f"unexpected weight {name!r} for a {arch.architecture} model")
        part = _KV_SCALE_NAMES.get(match["part"], match["part"])
        module_path, _, param_name = part.rpartition(".")
        module_path, shard_id = _MERGED_INTO.get(module_path, (module_path, None))
        try:
            module = self.layers[int(match["layer"])].get_submodule(module_path)
        except AttributeError:
            raise ValueError(f"unexpected weight {name!r} for a {arch.architecture} model") from None
        allowed = ("weight", "bias", *_KV_SCALES) if isinstance(module, SelfAttention) else ("weight", "bias")
        if param_name not in allowed and param_name not in getattr(module, "param_layouts", ()):
            raise ValueError(f"unexpected weight {name!r} for a {arch.architecture} model")
        return module, param_name, shard_id

    def _quantized_weight_names(self, names: set[str]) -> set[str]:
        """`names` with each quantized linear layer's `.weight` replaced by the tensors its method
        reads (qweight, scales, ... : LinearBase.checkpoint_params)."""
        result = set()
        for name in names:
            target = self.linear_for_weight(name) if name.endswith(".weight") else None
            if target is None or target[0].weight_is_shared:
                result.add(name)
            else:
                stem = name.removesuffix(".weight")
                result.update(f"{stem}.{param}" for param in target[0].checkpoint_params)
        return result

    @property
    def checkpoint_layer_weights(self) -> tuple[str, ...]:
        """Each layer's tensors a checkpoint must hold (the arch adds biases and Q/K norms)."""
        return _LAYER_WEIGHTS

    def _expected_weight_names(self) -> set[str]:
        arch = self.arch
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not arch.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(arch.num_layers):
            prefix = f"model.layers.{i}."
            names.update(prefix + n for n in self.checkpoint_layer_weights)
            if arch.attention_bias:
                names.update(prefix + f"self_attn.{p}_proj.bias" for p in "qkv")
            if arch.o_proj_bias:
                names.add(prefix + "self_attn.o_proj.bias")
            if arch.qk_norm:
                names.update((prefix + "self_attn.q_norm.weight", prefix + "self_attn.k_norm.weight"))
        return names


_LAYER_NAME = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?P<part>.+)")
# Checkpoint modules loaded as shards of one of our merged linear layers.
_MERGED_INTO: dict[str, tuple[str, ShardId]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# The FP8 KV cache's per-layer scales (SelfAttention.k_scale / v_scale), under the names checkpoints
# use: compressed-tensors' kv_cache_scheme writes self_attn.k_scale / v_scale (older ones
# k_proj.output_scale / v_proj.output_scale). Optional: without them the scales stay 1.0.
_KV_SCALES = ("k_scale", "v_scale")
_KV_SCALE_NAMES = {
    "self_attn.k_proj.output_scale": "self_attn.k_scale",
    "self_attn.v_proj.output_scale": "self_attn.v_scale",
}

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
