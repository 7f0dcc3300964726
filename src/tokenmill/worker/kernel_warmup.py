"""Start-up warm-up of the eager step shapes that the profiling run and the CUDA graphs miss.

Triton compiles a kernel variant the first time a process launches it (seconds with an empty
cache, tens to hundreds of milliseconds to load one from the on-disk cache), and the engine
would otherwise pay that inside a user's request. The memory profile runs one large prefill and
the graphs cover decode-only batches; serving also runs eager steps with 1-8 rows (a short
prefill chunk, e.g. after a prefix-cache hit: the row GEMV without a residual, the skinny GEMM
with the non-deferred layer path), mixed prefill + decode batches, and with --enforce-eager
decode-only steps. Each shape below runs once against a one-request-sized scratch KV cache;
slot -1 writes nothing.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata

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
    max_reqs = max(len(lens) for lens, _ in steps)
    caches = allocate_kv_caches(
        arch.num_layers, blocks_per_req * max_reqs, runner.block_size, arch.num_kv_heads, arch.head_dim,
        runner.dtype, device,
    )  # fmt: skip
    for lens, is_decode_only in steps:
        query_lens = [1] * len(lens) if is_decode_only else list(lens)
        num_tokens = sum(query_lens)
        qsl = np.zeros(len(lens) + 1, np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        seq_lens = np.asarray(lens, np.int32)
        meta = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=len(lens),
            max_query_len=max(query_lens),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=torch.from_numpy(qsl).to(device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            block_tables=torch.arange(blocks_per_req * len(lens), dtype=torch.int32, device=device).view(
                len(lens), blocks_per_req
            ),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=device),
            query_start_loc_cpu=torch.from_numpy(qsl),
            seq_lens_cpu=torch.from_numpy(seq_lens),
            is_decode_only=is_decode_only,
        )
        positions = torch.cat(
            [torch.arange(s - q, s, device=device) for q, s in zip(query_lens, lens, strict=True)]
        )
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        hidden = runner.model(input_ids, positions, caches, meta)
        last_rows = torch.from_numpy(qsl[1:] - 1).to(device=device, dtype=torch.long)
        runner.model.compute_logits(hidden[last_rows])
    if device.type == "cuda":
        torch.cuda.synchronize()
    del caches
    logger.info(
        "warmed up %d eager step shapes in %.1f s",
        len(steps),
        time.perf_counter() - started,
    )
