"""What happened to one request inside the engine, with times: the tail's evidence.

Filled by the engine core's step tracer (engine/step_trace.py) only when tracing is on
(`--trace-dir`), and sent with the request's final output so the API server can log it beside its
own times. Every time is `time.monotonic()` seconds: on Linux one clock for every process of the
host, so the API server's, the engine's and a local load generator's stamps compare directly.
"""

from __future__ import annotations

import msgspec


class RequestTimeline(msgspec.Struct, omit_defaults=True):
    arrival: float  # stamped by the API server after tokenization (the request's arrival_time)
    received: float  # the engine core took it off its socket
    prompt_tokens: int = 0
    # Each step that computed part of the prompt (again after a preemption), with the time it was
    # scheduled, the step's number and the chunk's tokens.
    prefill_chunks: list[tuple[float, int, int]] = []
    first_token: float = 0.0  # the first sampled token reached the engine's host side
    preempted: list[float] = []  # each time it lost its KV blocks to a preemption
    finished: float = 0.0
    num_steps: int = 0  # steps it was scheduled in
