"""The attention backend interface: the one place model code touches the paged KV cache.

KV cache layout, per layer: a tensor of shape [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values). Token `i` of a request lives in slot
`block_table[i // block_size] * block_size + i % block_size`.

A batch is flattened: the tokens of all scheduled requests back to back (prefill chunks and
single-token decodes mixed). Request `r` owns query rows
`query_start_loc[r] : query_start_loc[r + 1]`; its context after this step is `seq_lens[r]` tokens,
so its query token `j` sits at position `seq_lens[r] - query_len[r] + j` and attends causally to
every cached position <= that one.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from tokenmill.config import KernelConfig
from tokenmill.kernels.qk_norm import QKNorm  # defined below the kernels; backends and layers import it here

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(slots=True)
class AttentionLayerSpec:
    """What one layer's attention asks of the backend beyond plain causal softmax attention.

    The backend instance is shared by every layer; the layer passes its spec with each call.
    """

    # A query at position p sees keys at positions p - sliding_window < k <= p (transformers'
    # semantics: the window counts the query itself). None = every earlier position.
    sliding_window: int | None = None
    # Gemma 2: scores become cap * tanh(scores / cap) before the softmax. None = no cap.
    logits_soft_cap: float | None = None
    # gpt-oss: one learned logit per query head [num_heads] (float32) that joins every softmax's
    # denominator and attends to nothing. None = no sinks.
    sinks: torch.Tensor | None = None
    # The layer's FP8 KV cache scales (kernels/kv_fp8.py): stored = e4m3(value / scale), read as
    # stored * scale; float32 [num_kv_heads], one per KV head. Read only when the cache is FP8 (a
    # 16-bit cache ignores them); None = 1.0. SelfAttention puts its k_scale / v_scale buffers here:
    # fixed tensors filled in place, so CUDA graphs captured before the scales change still see them.
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(
                f"sliding_window must be a positive number of tokens (or None), got {self.sliding_window}"
            )
        if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be positive (or None), got {self.logits_soft_cap}")
        if self.sinks is not None and self.sinks.dim() != 1:
            raise ValueError(f"sinks must be one logit per query head [num_heads], got {tuple(self.sinks.shape)}")
        for name, scale in (("k_scale", self.k_scale), ("v_scale", self.v_scale)):
            if scale is not None and (scale.dim() != 1 or scale.dtype != torch.float32):
                raise ValueError(
                    f"{name} must be float32 with one scale per KV head [num_kv_heads], "
                    f"got {scale.dtype} {tuple(scale.shape)}"
                )

    @property
    def is_plain(self) -> bool:
        return self.sliding_window is None and self.logits_soft_cap is None and self.sinks is None

    def features(self) -> list[str]:
        """The non-plain features this spec uses, by name (for error messages)."""
        named = []
        if self.sliding_window is not None:
            named.append("sliding window")
        if self.logits_soft_cap is not None:
            named.append("logit soft-capping")
        if self.sinks is not None:
            named.append("attention sinks")
        return named


PLAIN_ATTENTION = AttentionLayerSpec()


class KVLayerHooks(Protocol):
    """A KV connector's per-layer hooks (worker/kv_connector/base.py), called by each attention layer
    of a step that moves KV: before the layer touches its cache (its loaded blocks must be there and
    the blocks saved from it copied out) and after its attention (its fresh KV may be shipped)."""

    def wait_for_layer_load(self, layer_index: int) -> None: ...

    def save_kv_layer(self, layer_index: int) -> None: ...


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout. With several KV cache groups (models with sliding-window layers,
    core/kv_cache_groups.py) each group has its own block tables and slot mapping: this object
    describes group 0 and carries one sibling per further group, which shares everything else;
    a layer attends with `meta.for_kv_group(its group)`."""

    num_actual_tokens: int  # rows of q/k/v that are real (the rest is CUDA-graph padding)
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32 (unused entries: 0)
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, write nowhere
    query_start_loc_cpu: torch.Tensor  # host copies, for the reference backend and for planning
    seq_lens_cpu: torch.Tensor
    is_decode_only: bool  # every request has query_len == 1
    # A speculative verification step: every request's query tokens (its last token and k drafts,
    # at most a few) sit at decode positions; a backend may serve them as decodes of several rows.
    multi_token_decode: bool = False
    # KV cache groups 1.. of this step (empty with one group). Built once per step, so a backend
    # that plans per metadata object plans once per group.
    kv_group_siblings: tuple[AttentionMetadata, ...] = ()
    # The KV connector of a step whose copies overlap the forward (None: nothing to wait for). A
    # layer calls its hooks around its attention; steps replayed as whole CUDA graphs cannot, and
    # wait for every layer's copies before the replay instead.
    kv_layer_hooks: KVLayerHooks | None = None

    def for_kv_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV cache group `group` (this object for group 0)."""
        return self if group == 0 else self.kv_group_siblings[group - 1]

    def with_kv_groups(self, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> AttentionMetadata:
        """Attach groups 1.. given as (block_tables, slot_mapping) each; returns self."""
        self.kv_group_siblings = tuple(
            replace(self, block_tables=block_tables, slot_mapping=slot_mapping, kv_group_siblings=())
            for block_tables, slot_mapping in tables
        )
        return self


class AttentionBackend(ABC):
    """Stores this step's K/V into the paged cache, then attends over it.

    One instance serves every layer of a model (the layer passes its own cache tensor).
    """

    name: str = "abstract"
    # Capabilities the model's forward asks about instead of checking names or devices.
    # Whether forward(kv_already_stored=True) may follow a RoPE launch that stored K/V itself (into
    # the cache layout above, at meta.slot_mapping).
    accepts_kv_stored_by_rope: bool = False
    # Whether forward_decode_with_rope also applies a deferred input RMSNorm (norm_source).
    fused_decode_rope_applies_norm: bool = False
    # Whether forward_decode_with_rope also applies a per-head Q/K RMSNorm (qk_norm), so that
    # models with one (Qwen3, Gemma 3) fuse their decode steps too.
    fused_decode_rope_applies_qk_norm: bool = False

    # Whether multi_token_decode steps read each KV tile once for all of a request's query tokens.
    supports_multi_token_decode: bool = False
    # Whether a decode step on this backend can be captured as a CUDA graph (no host reads, fixed
    # buffers refreshed by prepare_for_replay).
    supports_cuda_graphs: bool = False
    # Which AttentionLayerSpec features forward() honours (names as AttentionLayerSpec.features()).
    supported_layer_features: frozenset[str] = frozenset()

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
        *,
        kernel: KernelConfig | None = None,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size
        self.kernel = kernel or KernelConfig()  # the kernel-path choices a backend may read

    def auto_kv_cache_dtype(self, model_dtype: torch.dtype, *, quantized_weights: bool = False) -> torch.dtype:
        """The KV cache's element type under kv_cache_dtype "auto": the model's, unless a backend
        reads a narrower cache faster at no cost to greedy output (the C++ CPU backend, e.g. under
        a GGUF checkpoint's quantized weights: `quantized_weights`)."""
        return model_dtype

    def supports_kv_cache_dtype(self, kv_cache_dtype: torch.dtype, model_dtype: torch.dtype) -> bool:
        """Whether this backend reads and writes a KV cache of `kv_cache_dtype` under a model of
        `model_dtype`. Here: 16- and 32-bit floats, converted on store and load (the C++ backend);
        a backend that stores the scaled FP8 format (kernels/kv_fp8.py, the layer's k_scale /
        v_scale) says so for torch.float8_e4m3fn."""
        return kv_cache_dtype.is_floating_point and kv_cache_dtype.itemsize >= 2

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        *,
        kv_already_stored: bool = False,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; padding rows are unspecified
        """Write k/v at meta.slot_mapping (unless a fused kernel already did), then paged
        attention for every query row, as `layer` asks (see check_layer_spec)."""

    def unsupported_layer_features(self, layer: AttentionLayerSpec) -> list[str]:
        """The features `layer` needs that this backend does not honour (empty = it can run it)."""
        return [f for f in layer.features() if f not in self.supported_layer_features]

    def check_layer_spec(self, layer: AttentionLayerSpec, where: str = "this model") -> None:
        """Raise ValueError naming what `layer` needs that this backend lacks; the model runner
        calls it for every layer before the first step, so nothing is silently approximated."""
        missing = self.unsupported_layer_features(layer)
        if missing:
            raise ValueError(
                f"{where} needs {', '.join(missing)} in attention, which the {self.name} attention "
                "backend does not implement; choose another --attention-backend"
            )

    def supports_fused_decode_rope(self, meta: AttentionMetadata) -> bool:
        """Whether this step may go through forward_decode_with_rope (RoPE, the KV store and
        attention in one launch). None here."""
        return False

    def forward_decode_with_rope(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], not yet rotated
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], not yet rotated
        v: torch.Tensor,
        positions: torch.Tensor,  # [num_tokens] int64
        cos_cache: torch.Tensor,  # RotaryEmbedding's tables
        sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        norm_source: torch.Tensor | None = None,
        norm_eps: float = 0.0,
        qk_norm: QKNorm | None = None,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        """A decode-only step's RoPE, KV store and attention in one launch: only for backends whose
        supports_fused_decode_rope says so. `qk_norm` (only where fused_decode_rope_applies_qk_norm):
        q and k still need their per-head RMSNorm, before RoPE."""
        raise NotImplementedError(
            f"the {self.name} attention backend does not fuse RoPE into decode attention"
        )

    # CUDA-graph hooks (mini-sglang style): a backend that keeps its own buffers sizes them once
    # before capture and refreshes them before each replay. The torch reference needs neither.
    def prepare_for_capture(  # noqa: B027
        self, max_num_reqs: int, max_blocks_per_req: int, max_decode_query_len: int = 1
    ) -> None:
        """`max_decode_query_len`: the most query tokens per request of the decode steps that will be
        captured (1 + k for speculative verification)."""

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:  # noqa: B027
        pass


def get_attention_backend(name: str, device: torch.device) -> type[AttentionBackend]:
    """`auto` picks triton on CUDA, the C++ kernels on CPU (the torch reference where they cannot be
    built, with a warning saying why) and the torch reference elsewhere."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        elif device.type == "cpu":
            from tokenmill.kernels.cpu.build import cpu_kernels_available

            available, why = cpu_kernels_available()
            if not available:
                logger.warning("using the torch reference attention backend: %s", why)
            name = "cpu" if available else "torch"
        else:
            name = "torch"
    if name == "cpu":
        from tokenmill.attention.cpu_paged import CpuPagedBackend

        return CpuPagedBackend
    if name == "torch":
        from tokenmill.attention.torch_ref import TorchReferenceBackend

        return TorchReferenceBackend
    if name == "triton":
        from tokenmill.attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend
    raise ValueError(f"unknown attention backend {name!r}; expected one of: {', '.join(ATTENTION_BACKENDS)}")
