"""What tensor parallelism can split, checked before any worker starts, and each rank's heads.

Supported: the dense Llama decoder (llama, mistral, qwen2, qwen3), Phi-3 (its fused qkv / gate_up
tensors split per part), Gemma 2 and Gemma 3 (text), and the mixture-of-experts decoders (mixtral,
qwen2_moe, qwen3_moe, gpt_oss: every expert's intermediate dimension split over the ranks, the router
whole), with 16/32-bit weights (HF safetensors / .bin, GGUF dequantized at load, dummy) or quantized
ones whose blocks every shard keeps whole (loader/quant_config.py tensor_parallel_refusal). The query
heads split evenly; the KV heads split evenly, or, with fewer KV heads than ranks, each is
replicated on size / num_kv_heads ranks; the MLPs' and experts' intermediate sizes split evenly.
Any other family is refused by name here (and options in EngineArgs: a drafter model, an FP8 KV
cache, KV connectors) rather than run wrong.
"""

from __future__ import annotations

import dataclasses

from tokenmill.model.arch import ArchConfig

TENSOR_PARALLEL_FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen2_moe", "qwen3_moe",
    "gpt_oss",
)  # fmt: skip


def check_tensor_parallel(arch: ArchConfig, size: int, quantization: object | None = None) -> None:
    """ValueError naming what stops `arch` from splitting over `size` ranks; nothing for size 1."""
    if size == 1:
        return
    if arch.architecture not in TENSOR_PARALLEL_FAMILIES:
        raise ValueError(
            f"tensor_parallel_size={size}: the {arch.architecture!r} family is not sharded for tensor "
            f"parallelism yet (supported: {', '.join(TENSOR_PARALLEL_FAMILIES)}); use tensor_parallel_size=1"
        )
    if quantization is not None:
        from tokenmill.model.loader.quant_config import tensor_parallel_refusal

        if (reason := tensor_parallel_refusal(quantization, arch, size)) is not None:
            raise ValueError(f"tensor_parallel_size={size}: {reason}")
    heads, kv_heads = arch.num_heads, arch.num_kv_heads
    if heads % size:
        divisors = [n for n in range(1, heads + 1) if heads % n == 0 and _kv_heads_fit(kv_heads, n)]
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {heads} attention heads; "
            f"sizes that work for this model: {', '.join(map(str, divisors))}"
        )
    if not _kv_heads_fit(kv_heads, size):
        raise ValueError(
            f"tensor_parallel_size={size} and the model's {kv_heads} KV heads: one must divide the other "
            "(KV heads are split over the ranks, or replicated when there are fewer of them than ranks)"
        )
    for what, width in _intermediate_sizes(arch):
        if width % size:
            raise ValueError(
                f"tensor_parallel_size={size} does not divide the model's {what} ({width}): each rank "
                "holds an equal share of its columns"
            )


def _intermediate_sizes(arch: ArchConfig) -> list[tuple[str, int]]:
    """(name, width) of every MLP's intermediate dimension the layers split over the ranks."""
    moe = arch.moe
    sizes = []
    if moe is None or len(moe.sparse_layers) < arch.num_layers:  # some dense MLP
        sizes.append(("MLP intermediate size", arch.intermediate_size))
    if moe is not None:
        sizes.append(("experts' intermediate size", moe.expert_intermediate_size))
        if moe.shared_expert_intermediate_size:
            sizes.append(("shared expert's intermediate size", moe.shared_expert_intermediate_size))
    return sizes


def _kv_heads_fit(kv_heads: int, size: int) -> bool:
    return kv_heads % size == 0 if size <= kv_heads else size % kv_heads == 0


def rank_arch(arch: ArchConfig, size: int) -> ArchConfig:
    """`arch` as one rank's attention sees it: its query heads and its KV heads (one, replicated,
    when there are fewer KV heads than ranks). The KV pool and the attention backend use it."""
    if size == 1:
        return arch
    return dataclasses.replace(
        arch, num_heads=arch.num_heads // size, num_kv_heads=max(1, arch.num_kv_heads // size)
    )
