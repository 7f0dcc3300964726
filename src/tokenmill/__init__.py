"""tokenmill: an LLM inference and serving engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

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
