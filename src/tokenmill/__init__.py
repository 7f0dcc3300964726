"""tokenmill: an LLM inference and serving engine."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# OpenMP threads that spin while waiting make CPU inference collapse as soon as anything else
# runs on the machine (the API server beside the engine, a benchmark client): measured here, a
# 64x576x3072 matmul on 2 threads took 12 ms spinning and 3.4 ms passive under load. This must be
# set before torch loads its OpenMP runtime; users who set it themselves keep their choice.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tokenmill.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]


def __getattr__(name: str):  # lazy: importing tokenmill must not import torch
    if name == "LLM":
        from tokenmill.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
