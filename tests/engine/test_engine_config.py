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


def test_the_api_server_leaves_the_device_to_the_engine_core(tiny_llama_dir):
    # `tokenmill serve` builds its config without torch: device "auto" and the step budget stay
    # unresolved until the engine core resolves them (and reports them in EngineInfo).
    from tokenmill.args import EngineArgs, resolve_device_defaults
    from tokenmill.engine.engine_core import EngineCore

    config = EngineArgs(model=str(tiny_llama_dir)).create_engine_config(resolve_device=False)
    assert (config.device, config.scheduler.max_num_batched_tokens, config.async_scheduling) == ("auto", None, None)
    import torch

    expected = ("cuda", 8192, True) if torch.cuda.is_available() else ("cpu", 512, False)
    resolved = resolve_device_defaults(config)
    assert (resolved.device, resolved.scheduler.max_num_batched_tokens, resolved.async_scheduling) == expected
    assert resolve_device_defaults(resolved) == resolved
    core = EngineCore(config)
    assert (core.info.device.split(":")[0], core.info.max_num_batched_tokens, core.async_scheduling) == expected
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        EngineArgs(model=str(tiny_llama_dir), device="tpu").create_engine_config(resolve_device=False)


def test_cpu_prefill_cap_while_decoding_defaults_to_128_and_a_given_one_wins(tiny_llama_dir):
    # A CPU prefill token costs every decoding stream in its step ~2-4 ms (docs/CPU_PERFORMANCE.md):
    # the CPU caps a step's prefill while requests decode; 0 turns the cap off.
    from tokenmill.args import DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING_CPU

    config = build_engine_config(str(tiny_llama_dir), device="cpu")
    assert config.scheduler.max_prefill_tokens_while_decoding == DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING_CPU == 128
    for given in (0, 64):
        config = build_engine_config(str(tiny_llama_dir), device="cpu", max_prefill_tokens_while_decoding=given)
        assert config.scheduler.max_prefill_tokens_while_decoding == given
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding must be >= 0"):
        build_engine_config(str(tiny_llama_dir), device="cpu", max_prefill_tokens_while_decoding=-1)


def test_the_offline_llm_leaves_the_prefill_cap_off_unless_asked(tiny_llama_dir):
    from tokenmill import LLM

    assert LLM(str(tiny_llama_dir), device="cpu").config.scheduler.max_prefill_tokens_while_decoding == 0
    # `bench throughput` passes every option, unset ones as None
    llm = LLM(str(tiny_llama_dir), device="cpu", max_prefill_tokens_while_decoding=None)
    assert llm.config.scheduler.max_prefill_tokens_while_decoding == 0
    llm = LLM(str(tiny_llama_dir), device="cpu", max_prefill_tokens_while_decoding=32)
    assert llm.config.scheduler.max_prefill_tokens_while_decoding == 32


def test_prefill_step_target_defaults_on_the_cpu_off_offline_and_a_given_one_wins(tiny_llama_dir):
    from tokenmill import LLM
    from tokenmill.args import DEFAULT_PREFILL_STEP_TARGET_MS_CPU

    config = build_engine_config(str(tiny_llama_dir), device="cpu")
    assert config.scheduler.prefill_step_target_ms == DEFAULT_PREFILL_STEP_TARGET_MS_CPU > 0
    config = build_engine_config(str(tiny_llama_dir), device="cpu", prefill_step_target_ms=0)
    assert config.scheduler.prefill_step_target_ms == 0
    with pytest.raises(ValueError, match="prefill_step_target_ms must be >= 0"):
        build_engine_config(str(tiny_llama_dir), device="cpu", prefill_step_target_ms=-1)
    assert LLM(str(tiny_llama_dir), device="cpu").config.scheduler.prefill_step_target_ms == 0
    assert LLM(str(tiny_llama_dir), device="cpu", prefill_step_target_ms=None).config.scheduler.prefill_step_target_ms == 0
