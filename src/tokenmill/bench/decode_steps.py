"""Scheduler outputs for uniform decode steps built by hand: every request computes the same q
tokens at decode positions (past its prompt), as a speculative verification step does (its last
token and q - 1 drafts). Known tokens stand in for the drafts, so no proposer is needed: the
benchmarks and GPU tests that time or check the runner's verification shapes use these.
"""

from __future__ import annotations

import random

from tokenmill.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.sampling_params import SamplingParams


def uniform_decode_step(
    num_reqs: int,
    tokens_per_req: int,
    context_len: int,
    block_size: int,
    vocab_size: int,
    *,
    prompt_len: int = 16,
    first_block: int = 0,
    seed: int = 0,
    id_prefix: str = "req",
) -> tuple[SchedulerOutput, SchedulerOutput]:
    """(the first step, scheduling the requests as new; the same step again for requests the
    runner already holds). Request i has `prompt_len` prompt tokens and known output tokens up to
    context_len + tokens_per_req, has computed context_len of them, and computes the next
    tokens_per_req; it owns blocks first_block + i * n .. + n - 1 (n blocks hold the whole step).

    The repeat step recomputes the same positions: the runner appends each step's sampled token to
    its history, which a caller that repeats it may trim back (the positions stay the same)."""
    if context_len < prompt_len:
        raise ValueError(f"context_len ({context_len}) must be at least prompt_len ({prompt_len}): decode positions")
    if tokens_per_req < 1 or num_reqs < 1:
        raise ValueError(f"num_reqs ({num_reqs}) and tokens_per_req ({tokens_per_req}) must be >= 1")
    rng = random.Random(seed)
    total = context_len + tokens_per_req
    blocks_per_req = -(-total // block_size)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    new_reqs = []
    for i in range(num_reqs):
        tokens = [rng.randrange(vocab_size) for _ in range(total)]
        start = first_block + i * blocks_per_req
        new_reqs.append(
            NewRequestData(
                request_id=f"{id_prefix}{i}",
                prompt_token_ids=tokens[:prompt_len],
                sampling_params=params,
                eos_token_ids=(),
                block_ids=[list(range(start, start + blocks_per_req))],
                num_computed_tokens=context_len,
                output_token_ids=tokens[prompt_len:],
            )
        )
    ids = [new.request_id for new in new_reqs]
    scheduled = dict.fromkeys(ids, tokens_per_req)
    first = SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=num_reqs * tokens_per_req,
    )
    again = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(request_ids=ids, num_computed_tokens=[context_len] * num_reqs),
        num_scheduled_tokens=dict(scheduled),
        total_num_scheduled_tokens=num_reqs * tokens_per_req,
    )
    return first, again


def blocks_needed(num_reqs: int, tokens_per_req: int, context_len: int, block_size: int) -> int:
    """How many KV blocks `uniform_decode_step` hands out (from first_block on)."""
    return num_reqs * -(-(context_len + tokens_per_req) // block_size)
