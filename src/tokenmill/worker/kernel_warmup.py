"""Start-up warm-up of the eager step shapes that the profiling run and the CUDA graphs miss.

Triton compiles a kernel variant the first time a process launches it (seconds with an empty
cache, tens to hundreds of milliseconds to load one from the on-disk cache), and the engine
would otherwise pay that inside a user's request. The memory profile runs one large prefill and
the graphs cover decode-only batches; serving also runs eager steps with 1-8 rows (a short
prefill chunk, e.g. after a prefix-cache hit: the row GEMV without a residual, the skinny GEMM
with the non-deferred layer path), mixed prefill + decode batches, and with --enforce-eager
decode-only steps. Each shape below runs once against a one-request-sized scratch KV cache
(worker/scratch_step.py); slot -1 writes nothing.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

# (tokens per request) of each warm-up step; a request of 1 token after others of more is a decode
# in a mixed batch (its context is taken as its own length, so every query attends to itself).
WARMUP_STEPS: tuple[tuple[int, ...], ...] = (
    (1,),  # a one-token prefill: every matmul one row, outside the graphs
    (3,),  # a 3-token prefill: 3-row matmuls
    (4, 1, 1),  # a short prefill chunk with two decodes: a mixed batch of 6 rows
    (8,),  # prefill attention tiles are sized by the longest chunk: 8 tokens take 32 rows,
    (16, 1),  # 16 take 64 (a mixed batch of 17 rows, cuBLAS); the profile run compiled 128
)


@torch.inference_mode()
def warm_up_eager_steps(runner) -> None:
    from tokenmill.worker.kv_cache import allocate_kv_caches
    from tokenmill.worker.scratch_step import scratch_step

    started = time.perf_counter()
    arch = runner.arch
    device = runner.device
    # With --enforce-eager, decode-only steps run eagerly too: one request (the fused RoPE and
    # deferred-norm path) and three, each with a 4-token context.
    decode_only_steps = [(4,), (4, 4, 4)] if runner.graph_runner is None else []
    # (Positions past max_model_len have no RoPE table entries.)
    steps = [(lens, False) for lens in WARMUP_STEPS] + [(lens, True) for lens in decode_only_steps]
    steps = [(lens, decode_only) for lens, decode_only in steps if max(lens) <= runner.max_model_len]
    if not steps:
        return
    longest = max(max(lens) for lens, _ in steps)
    blocks_per_req = -(-longest // runner.block_size)
    caches = allocate_kv_caches(
        arch.num_layers,
        blocks_per_req,
        runner.block_size,
        arch.num_kv_heads,
        arch.head_dim,
        runner.kv_cache_dtype,
        device,
    )
    for lens, is_decode_only in steps:
        query_lens = [1] * len(lens) if is_decode_only else list(lens)
        positions, meta = scratch_step(
            query_lens, list(lens), blocks_per_req, device, is_decode_only, runner.kv_groups.num_groups
        )
        num_tokens = meta.num_actual_tokens
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        hidden = runner.model(input_ids, positions, caches, meta)
        last_rows = (meta.query_start_loc[1:] - 1).long()
        runner.model.compute_logits(hidden[last_rows])
    if device.type == "cuda":
        torch.cuda.synchronize()
    del caches
    logger.info(
        "warmed up %d eager step shapes in %.1f s",
        len(steps),
        time.perf_counter() - started,
    )
