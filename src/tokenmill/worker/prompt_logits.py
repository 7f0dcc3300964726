"""The logits at every position of one prompt, through a loaded runner's own model and attention
backend: what a step computes, but for all rows instead of the last one.

The quality gate (quality/measure.py) needs the full next-token distribution at every position of
a text to compare two models; a request's `prompt_logprobs` gives only the top few. The prompt runs
as one prefill against a KV cache of its own, sized for it, so the engine's pool (and the prefix
cache whose blocks it holds) is left untouched, and no request needs to be scheduled.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tokenmill.attention.backend import AttentionMetadata
from tokenmill.worker.kv_cache import allocate_kv_caches


@torch.inference_mode()
def prompt_logits(runner, token_ids: Sequence[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] on the runner's device: row p scores the token after
    position p. `runner` is a ModelRunner whose model is loaded."""
    num_tokens = len(token_ids)
    if num_tokens < 1:
        raise ValueError("prompt_logits needs at least one token")
    if num_tokens > runner.max_model_len:
        raise ValueError(
            f"a prompt of {num_tokens} tokens is longer than max_model_len={runner.max_model_len}; "
            "use shorter prompts or a larger max_model_len"
        )
    device = runner.device
    num_blocks = -(-num_tokens // runner.block_size)
    # One tensor per layer (not the pool's grouped layout): every KV cache group can then use the
    # same blocks 0..num_blocks-1 without two groups' layers writing into the same tensor.
    caches = allocate_kv_caches(
        runner.arch.num_layers, num_blocks, runner.block_size, runner.rank_arch.num_kv_heads,
        runner.arch.head_dim, runner.kv_cache_dtype, device,
    )  # fmt: skip
    query_start_loc = np.array([0, num_tokens], np.int32)
    seq_lens = np.array([num_tokens], np.int32)
    block_table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]
    slot_mapping = torch.arange(num_tokens, dtype=torch.long, device=device)  # blocks in order
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=1,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_tables=block_table,
        slot_mapping=slot_mapping,
        query_start_loc_cpu=torch.from_numpy(query_start_loc),
        seq_lens_cpu=torch.from_numpy(seq_lens),
        is_decode_only=num_tokens == 1,
    )
    num_groups = runner.kv_groups.num_groups
    if num_groups > 1:
        meta.with_kv_groups([(block_table, slot_mapping)] * (num_groups - 1))
    input_ids = torch.tensor(list(token_ids), dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, dtype=torch.long, device=device)
    hidden = runner.model(input_ids, positions, caches, meta)
    return runner.model.compute_logits(hidden[:num_tokens])
