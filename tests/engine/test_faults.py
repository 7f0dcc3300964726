"""Faults stay with the request that caused them: NaN logits, failing steps, tenants' caches."""

from __future__ import annotations

import pytest
import torch

from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _prompts(n: int, length: int = 24) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 900 + 50 for j in range(length)] for i in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_nan_logits_end_only_their_request_and_never_enter_the_prefix_cache(
    tiny_llama_dir, monkeypatch, async_scheduling
):
    llm = LLM(
        str(tiny_llama_dir), device="cpu", max_model_len=128, block_size=4, async_scheduling=async_scheduling
    )
    prompts = _prompts(4)
    model = llm.engine.runner.model
    real = model.compute_logits
    poisoned_row = {"armed": True}

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = real(hidden)
        # The third request of the batch gets NaN logits once its prompt is done.
        if poisoned_row["armed"] and logits.shape[0] == 4:
            logits[2] = float("nan")
            poisoned_row["armed"] = False
        return logits

    monkeypatch.setattr(model, "compute_logits", compute_logits)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    assert outputs[2].outputs[0].finish_reason == "error"
    assert "non-finite" in (outputs[2].error or "")
    for i in (0, 1, 3):
        assert outputs[i].outputs[0].finish_reason == "length"
        assert outputs[i].outputs[0].token_ids == hf_greedy(str(tiny_llama_dir), prompts[i], 8)[0]
    llm.engine.check_invariants()
    # The failed request's blocks were dropped from the prefix cache: asking again computes it afresh.
    again = llm.generate({"prompt_token_ids": prompts[2]}, PARAMS)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == hf_greedy(str(tiny_llama_dir), prompts[2], 8)[0]
    # Whereas a request that finished normally is reused.
    assert llm.generate({"prompt_token_ids": prompts[0]}, PARAMS)[0].num_cached_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failing_step_ends_its_batch_and_the_engine_keeps_serving(
    tiny_llama_dir, monkeypatch, async_scheduling
):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, async_scheduling=async_scheduling)
    runner = llm.engine.runner
    method = "execute_async" if async_scheduling else "execute"
    real = getattr(runner, method)
    calls = {"n": 0}

    def execute(so):
        calls["n"] += 1
        if calls["n"] == 2 and not so.is_empty:
            raise RuntimeError("injected device fault")
        return real(so)

    monkeypatch.setattr(runner, method, execute)
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts(3)], PARAMS)
    assert all(o.outputs[0].finish_reason == "error" for o in outputs)
    assert "injected device fault" in (outputs[0].error or "")
    llm.engine.check_invariants()
    fine = llm.generate({"prompt_token_ids": _prompts(1)[0]}, PARAMS)[0]
    assert fine.outputs[0].finish_reason == "length"


def test_cache_salt_separates_tenants(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, block_size=4)
    prompt = _prompts(1, length=40)[0]

    def cached(salt: str | None) -> int:
        request = (
            {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        )
        return llm.generate(request, PARAMS)[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same tokens, other tenant: no hit
    assert cached(None) == 0  # unsalted requests do not see salted blocks either
    assert cached("tenant-a") >= 36  # the same tenant does hit
    llm.engine.check_invariants()
