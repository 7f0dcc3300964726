"""GPU memory sizing: measure peak activation memory with a dummy forward, give the rest to the KV pool."""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Headroom for CUDA graphs' private pool and allocator fragmentation, beyond the measured peak.
GRAPH_AND_FRAGMENTATION_RESERVE = 512 * 2**20


@torch.inference_mode()
def profile_peak_memory(runner) -> int:
    """Runs the largest step the scheduler may produce (max_num_batched_tokens tokens, logits for
    max_num_seqs rows) against a tiny KV cache, and returns the peak bytes torch allocated."""
    from tokenmill.worker.kv_cache import allocate_kv_caches
    from tokenmill.worker.scratch_step import scratch_step

    sched = runner.config.scheduler
    arch = runner.rank_arch  # this rank's KV heads (the whole model's when not tensor-parallel)
    num_tokens = sched.max_num_batched_tokens
    seq_len = min(runner.max_model_len, num_tokens)
    lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = -(-seq_len // runner.block_size)
    temp_caches = allocate_kv_caches(
        arch.num_layers,
        blocks_per_seq,
        runner.block_size,
        arch.num_kv_heads,
        arch.head_dim,
        runner.kv_cache_dtype,
        runner.device,
    )
    positions, meta = scratch_step(
        lens, lens, blocks_per_seq, runner.device, False, runner.kv_groups.num_groups
    )
    input_ids = torch.randint(0, arch.vocab_size, (num_tokens,), device=runner.device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    hidden = runner.model(input_ids, positions, temp_caches, meta)
    rows = min(sched.max_num_seqs, num_tokens)
    logits = runner.model.compute_logits(hidden[:rows])
    # The sampler's working set: a few float32 copies of the logits (softmax, noise, masks).
    probs = torch.softmax(logits, dim=-1)
    noise = torch.empty_like(probs).exponential_()
    _ = (probs / noise).argmax(dim=-1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del hidden, logits, probs, noise, temp_caches
    torch.cuda.empty_cache()
    return int(peak)


def num_blocks_for_gpu(runner, bytes_per_block: int, min_blocks: int) -> int:
    cache = runner.config.cache
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    torch.cuda.empty_cache()
    free_before, total = torch.cuda.mem_get_info()
    torch_reserved = torch.cuda.memory_reserved()
    non_torch = total - free_before - torch_reserved  # CUDA context and other processes' memory
    peak = profile_peak_memory(runner)
    budget = int(total * cache.gpu_memory_utilization) - non_torch - peak - GRAPH_AND_FRAGMENTATION_RESERVE
    num_blocks = budget // bytes_per_block
    logger.info(
        "memory: total %.1f GiB, non-torch %.2f GiB, peak with weights and activations %.2f GiB -> KV budget %.2f GiB",
        total / 2**30, non_torch / 2**30, peak / 2**30, max(budget, 0) / 2**30,
    )  # fmt: skip
    if num_blocks < min_blocks:
        raise ValueError(
            f"after weights and activations only {max(num_blocks, 0)} KV blocks fit in "
            f"gpu_memory_utilization={cache.gpu_memory_utilization}, fewer than the {min_blocks} one max_model_len "
            "sequence needs; raise --gpu-memory-utilization, lower --max-model-len or --max-num-batched-tokens"
        )
    return int(num_blocks)
