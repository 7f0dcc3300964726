"""Filling in one rank's RunnerFacts (core/runner_facts.py) from its runner: what `bench latency`
builds its roofline from. Each rank answers for its own shard (worker_messages.DescribeRunner), so
a tensor-parallel engine's figures are the sum over its ranks, read through the executor.
"""

from __future__ import annotations

import time
from typing import Any

from tokenmill.core.runner_facts import RunnerFacts


def copy_bandwidth(device: str) -> float:
    """Bytes per second a large device-to-device copy moves, counting bytes read and written."""
    import torch

    if not device.startswith("cuda"):
        n = 256 * 2**20
        src = torch.empty(n, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        started = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        return 2 * n * 5 / (time.perf_counter() - started)
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 10 / seconds


def describe_runner(runner: Any, rank: int, measure_bandwidth: bool = False) -> RunnerFacts:
    """`runner`'s facts (after its KV pool is allocated: the cache's dtype sets the KV bytes)."""
    import torch

    from tokenmill.model.layers.moe import unread_expert_bytes
    from tokenmill.model.layers.quantized_linear import gguf_block_bytes, quantized_blocks
    from tokenmill.model.layers.quantized_method import kernel_weight_bytes

    model = runner.model
    embedding = 0.0
    gguf_blocks = gguf_block_bytes(model)
    if not model.lm_head.weight_is_shared or quantized_blocks(model.lm_head) is not None:
        # The table is read a row a token; a tied lm_head served by GGUF blocks reads those instead.
        embedding = float(model.embed_tokens.numel() * model.embed_tokens.element_size())
    unread = float(unread_expert_bytes(model))
    weight_bytes = (
        sum(p.numel() * p.element_size() for p in model.parameters())
        + kernel_weight_bytes(model)  # quantized layers' FP8 / INT4 tensors, scales and zeros
        + gguf_blocks  # GGUF blocks (CPU), whose float weights are gone or unread by decode steps
        - embedding
        - unread
    )
    arch = runner.rank_arch  # this rank's KV heads (replicated ones counted on every rank holding them)
    itemsize = runner.kv_cache_tensors[0].element_size()  # the cache's own dtype (fp8: 1 byte)
    device = str(runner.device)
    if device.startswith("cuda"):
        device_name = torch.cuda.get_device_name(torch.device(device))
    else:
        device_name = device  # the result file's "device" names the CPU model
    return RunnerFacts(
        rank=rank,
        device=device,
        device_name=device_name,
        decode_weight_bytes=float(weight_bytes),
        embedding_bytes=embedding,
        unread_expert_bytes=unread,
        kv_bytes_per_token=float(2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * itemsize),
        cuda_graphs=runner.graph_runner is not None,
        copy_bandwidth_bytes_per_s=copy_bandwidth(device) if measure_bandwidth else None,
    )
