"""Bytes of a model's weights and of its KV cache, from its ArchConfig alone (no weights read).

Weights count as the engine stores them (and as `bench latency` reports its `weight_bytes`):
16-bit tensors at 2 bytes (4 in fp32); FP8 W8A8 linear layers at 1 byte a weight plus 8 bytes per
output row (fp32 per-channel scale and the kernel's per-row scale); AWQ / GPTQ 4-bit at half a
byte a weight plus 4 bytes per group of 128 per output row (fp16 scale and zero) and 1 byte per
output row. The embedding, lm_head and norms stay 16-bit. One decode step reads every weight but
the input embedding (it gathers one row per token; a tied lm_head reads it anyway) and, of each
mixture-of-experts layer, only the routed experts its tokens pick.

The KV cache's per-token bytes follow the engine's pool (worker/kv_cache.py): K and V of
num_kv_heads x head_dim per layer at the cache dtype (fp8: 1 byte), with sliding-window layers
grouped by core/kv_cache_groups.py, whose block math this module reuses.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.core.kv_cache_groups import KVCacheGroups, plan_kv_cache_groups
from tokenmill.model.arch import ArchConfig

INT4_GROUP_SIZE = 128
QUANTIZATIONS = ("fp8", "awq", "gptq")


def linear_bytes(in_features: int, out_features: int, quantization: str | None, dtype_bytes: int) -> float:
    if quantization is None:
        return float(in_features * out_features * dtype_bytes)
    if quantization == "fp8":
        return float(in_features * out_features + 8 * out_features)
    if quantization in ("awq", "gptq"):
        groups = -(-in_features // INT4_GROUP_SIZE)
        return in_features * out_features / 2 + 4 * groups * out_features + out_features
    raise ValueError(f"unknown quantization {quantization!r}; one of {', '.join(QUANTIZATIONS)} or none")


@dataclass(frozen=True, slots=True)
class ModelBytes:
    """What the weights cost in memory and what one decode step reads."""

    dense_read_bytes: float  # read by every decode step whatever the batch (all but embedding, routed experts)
    embedding_bytes: float  # the untied input embedding table (held, not read)
    expert_bytes: float  # one routed expert of one layer
    num_sparse_layers: int
    num_experts: int
    top_k: int
    params_per_token: float  # multiply-adds per token / 1: the active parameters (no embedding gather)

    @property
    def total_bytes(self) -> float:
        return self.dense_read_bytes + self.embedding_bytes + self.num_sparse_layers * self.num_experts * self.expert_bytes

    def decode_read_bytes(self, batch: int) -> float:
        """Weight bytes one decode step of `batch` tokens reads: each routed expert at most once, the
        expected number of distinct experts `batch` tokens pick (uniform routing)."""
        if not self.num_experts:
            return self.dense_read_bytes
        untouched = (1 - self.top_k / self.num_experts) ** max(batch, 1)
        experts = self.num_experts * (1 - untouched)
        return self.dense_read_bytes + self.num_sparse_layers * experts * self.expert_bytes


def model_bytes(arch: ArchConfig, quantization: str | None = None, dtype_bytes: int = 2) -> ModelBytes:
    hidden, q, kv = arch.hidden_size, arch.q_size, arch.kv_size

    def lin(i: int, o: int) -> float:
        return linear_bytes(i, o, quantization, dtype_bytes)

    attention = lin(hidden, q) + 2 * lin(hidden, kv) + lin(q, hidden)
    attention_params = hidden * (q + 2 * kv) + q * hidden
    biases = (q + 2 * kv) * int(arch.attention_bias) + hidden * int(arch.o_proj_bias)
    norms = (4 if arch.architecture in ("gemma2", "gemma3") else 2) * hidden + (2 * arch.head_dim if arch.qk_norm else 0)
    def mlp(inter: int) -> float:  # gate and up (hidden -> inter), down (inter -> hidden)
        return 2 * lin(hidden, inter) + lin(inter, hidden)

    dense_mlp = mlp(arch.intermediate_size)
    dense_mlp_params = 3 * hidden * arch.intermediate_size
    moe = arch.moe
    sparse = set(moe.sparse_layers) if moe is not None else set()
    read = 0.0
    params = 0.0
    expert_bytes = 0.0
    for layer in range(arch.num_layers):
        read += attention + (biases + norms) * dtype_bytes
        params += attention_params
        if layer in sparse and moe is not None:
            expert_bytes = mlp(moe.expert_intermediate_size)
            shared = mlp(moe.shared_expert_intermediate_size) if moe.shared_expert_intermediate_size else 0.0
            router = hidden * moe.num_experts * dtype_bytes + (hidden * dtype_bytes if moe.shared_expert_intermediate_size else 0)
            read += shared + router
            params += (moe.top_k * moe.expert_intermediate_size + moe.shared_expert_intermediate_size) * 3 * hidden
            params += hidden * moe.num_experts
        else:
            read += dense_mlp
            params += dense_mlp_params
    embedding = arch.vocab_size * hidden * dtype_bytes
    read += embedding + hidden * dtype_bytes  # lm_head (or the tied embedding it reads) and the final norm
    params += arch.vocab_size * hidden
    return ModelBytes(
        dense_read_bytes=read,
        embedding_bytes=0.0 if arch.tie_word_embeddings else embedding,
        expert_bytes=expert_bytes,
        num_sparse_layers=len(sparse),
        num_experts=moe.num_experts if moe is not None else 0,
        top_k=moe.top_k if moe is not None else 0,
        params_per_token=params,
    )


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV pool's geometry for one GPU (a tensor-parallel rank holds its share of the KV heads)."""

    groups: KVCacheGroups
    block_size: int
    bytes_per_token_per_layer: int  # K and V of the heads this GPU holds
    max_chunk: int  # tokens one step computes (max_num_batched_tokens, at most max_model_len)

    @property
    def bytes_per_block(self) -> int:
        return self.groups.num_tensors * self.block_size * self.bytes_per_token_per_layer

    @property
    def bytes_per_token(self) -> int:
        """Every layer's K and V for one token (a full-attention model's cost per cached token)."""
        return self.groups.num_layers * self.bytes_per_token_per_layer

    def blocks_for(self, num_tokens: int) -> int:
        return self.groups.blocks_for_one_sequence(num_tokens, self.block_size, self.max_chunk)

    def max_sequences(self, num_blocks: int, num_tokens: int) -> int:
        """Sequences of `num_tokens` tokens that fit in `num_blocks` blocks at once."""
        return num_blocks // self.blocks_for(num_tokens)

    def mean_bytes_per_token(self, num_tokens: int) -> float:
        """KV bytes a sequence of `num_tokens` holds per token (less than bytes_per_token when layers slide)."""
        return self.blocks_for(num_tokens) * self.bytes_per_block / max(num_tokens, 1)


def kv_layout(
    arch: ArchConfig,
    max_model_len: int,
    *,
    kv_dtype_bytes: int = 2,
    block_size: int = 16,
    tensor_parallel: int = 1,
    max_num_batched_tokens: int = 8192,
) -> KVLayout:
    kv_heads = max(1, arch.num_kv_heads // tensor_parallel)  # fewer heads than ranks: each rank keeps one
    groups = plan_kv_cache_groups(arch.num_layers, arch.sliding_windows, max_model_len)
    return KVLayout(
        groups=groups,
        block_size=block_size,
        bytes_per_token_per_layer=2 * kv_heads * arch.head_dim * kv_dtype_bytes,
        max_chunk=min(max_num_batched_tokens, max_model_len),
    )
