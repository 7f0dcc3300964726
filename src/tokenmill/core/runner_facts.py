"""What one rank's runner holds and reads per decode step (the worker fills it in:
worker/runner_facts.py). msgspec, torch-free: it crosses the tensor-parallel worker protocol, which
the engine side imports.
"""

from __future__ import annotations

import msgspec


class RunnerFacts(msgspec.Struct, tag=True):
    rank: int
    device: str
    device_name: str  # e.g. "NVIDIA H100 80GB HBM3", or the CPU
    # Bytes one decode step reads of this rank's weights: every matrix once, but not an untied
    # input embedding (a step gathers one row per token) nor the routed experts a token skips.
    decode_weight_bytes: float
    embedding_bytes: float  # this rank's untied input embedding table (0 when tied)
    unread_expert_bytes: float  # routed-expert weights a one-token step does not read (MoE; else 0)
    kv_bytes_per_token: float  # this rank's KV heads over every layer, in the cache's own dtype
    cuda_graphs: bool
    copy_bandwidth_bytes_per_s: float | None = None  # measured only when asked (costs a second)
