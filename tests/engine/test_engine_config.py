"""Engine defaults that depend on the device."""

from __future__ import annotations

import pytest

from tokenmill.engine.llm import build_engine_config


def test_cpu_step_budget_defaults_to_512_tokens_and_a_given_one_wins(tiny_llama_dir):
    # 512, not the GPU's 8192: a CPU prefill runs at a few hundred tokens/s, so a bigger budget
    # holds every running stream for seconds per step (engine_core.py, BENCHMARKS.md).
    config = build_engine_config(str(tiny_llama_dir), device="cpu")
    assert config.scheduler.max_num_batched_tokens == 512
    config = build_engine_config(str(tiny_llama_dir), device="cpu", max_num_batched_tokens=2048)
    assert config.scheduler.max_num_batched_tokens == 2048
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        build_engine_config(str(tiny_llama_dir), device="cpu", max_num_batched_tokens=0)
