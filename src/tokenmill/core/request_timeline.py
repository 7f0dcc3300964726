"""What happened to one request inside the engine, with times: the tail's evidence.

Kept by the engine core for every request (engine/request_timelines.py) and sent with the
request's final output: the API server's dashboard keeps the recent ones (the slowest requests and
their timelines), and with `--trace-dir` logs them beside its own times. Every time is `time.monotonic()` seconds: on Linux one clock for every process of the
host, so the API server's, the engine's and a local load generator's stamps compare directly.
"""

from __future__ import annotations

import msgspec


class RequestTimeline(msgspec.Struct, omit_defaults=True):
    # The request's arrival_time: when its HTTP request reached the API server's route (before
    # parsing and tokenizing); offline, when it was tokenized.
    arrival: float
    received: float  # the engine core took it off its socket
    prompt_tokens: int = 0
    priority: int = 0  # its scheduling priority (the SLO class under the slo policy)
    # Each step that computed part of the prompt (again after a preemption), with the time it was
    # scheduled, the step's number and the chunk's tokens.
    prefill_chunks: list[tuple[float, int, int]] = []
    first_token: float = 0.0  # the first sampled token reached the engine's host side
    preempted: list[float] = []  # each time it lost its KV blocks to a preemption
    finished: float = 0.0
    num_steps: int = 0  # steps it was scheduled in
    output_tokens: int = 0  # tokens sampled for it (accepted drafts included)
