"""n > 1: one user request becomes n engine sequences, each with its own id and seed.

Both frontends (the offline LLM and the API server's AsyncEngine) fan out here, so a request gives
the same n completions offline and served.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from tokenmill.sampling_params import SamplingParams


class Child(NamedTuple):
    index: int  # the completion's index among the n
    request_id: str  # the engine's id for this sequence
    params: SamplingParams  # n = 1


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child `index` samples with `seed + index`, so a seeded request is reproducible and its n
    completions still differ; an unseeded one stays unseeded."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


def fan_out(request_id: str, params: SamplingParams) -> list[Child]:
    """The engine sequences of one user request: itself when n == 1, else `<id>-<index>` each."""
    if params.n == 1:
        return [Child(0, request_id, params)]
    return [Child(i, f"{request_id}-{i}", child_params(params, i)) for i in range(params.n)]
