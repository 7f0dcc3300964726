"""worker/prompt_logits.py: the logits at every position of a prompt, through a loaded engine's
model, equal transformers' on the same weights (the quality gate's full-vocabulary distributions)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.hf_oracle import load_hf
from tests.engine.sliding_window_checkpoints import WINDOW, write_sliding_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.worker.prompt_logits import prompt_logits


def _hf_logits(path, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return load_hf(str(path))(torch.tensor([token_ids])).logits[0].float()


def _prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab_size) for _ in range(length)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_every_position_equals_transformers(tiny_llama_dir, backend):
    llm = LLM(
        str(tiny_llama_dir), device="cpu", attention_backend=backend, num_kv_blocks=16, max_model_len=128
    )
    tokens = _prompt(llm.info.vocab_size, 45, seed=0)  # several KV blocks, the last one partly filled
    logits = prompt_logits(llm.engine.runner, tokens)
    assert logits.dtype == torch.float32 and logits.shape == (45, llm.info.vocab_size)
    torch.testing.assert_close(logits, _hf_logits(tiny_llama_dir, tokens), atol=1e-4, rtol=1e-4)
    # The engine's own KV pool was not touched: a request still runs, and to the same last logits.
    out = llm.generate({"prompt_token_ids": tokens}, SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert out.outputs[0].token_ids == [int(logits[-1].argmax())]
    llm.engine.check_invariants()


def test_sliding_window_layers_in_two_kv_cache_groups(tmp_path, tiny_tokenizer):
    path = write_sliding_checkpoint(tmp_path / "hybrid", "qwen2_hybrid", tiny_tokenizer)
    llm = LLM(str(path), device="cpu", num_kv_blocks=32, max_model_len=128)
    assert llm.engine.runner.kv_groups.num_groups == 2
    tokens = _prompt(llm.info.vocab_size, WINDOW + 20, seed=1)  # past the window: it must slide
    torch.testing.assert_close(
        prompt_logits(llm.engine.runner, tokens), _hf_logits(path, tokens), atol=1e-4, rtol=1e-4
    )


def test_a_prompt_longer_than_max_model_len_is_refused(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", num_kv_blocks=8, max_model_len=32)
    with pytest.raises(ValueError, match="longer than max_model_len=32"):
        prompt_logits(llm.engine.runner, list(range(3, 36)))
