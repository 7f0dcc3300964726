"""What every GPU test module shares."""

from __future__ import annotations

import gc

import pytest
import torch


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """After each test, drop its engine's KV pool, graphs and weights, so the next test's memory
    profiling sees a free device."""
    yield
    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
