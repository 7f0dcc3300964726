"""A tokenizer much smaller than the model's vocabulary is another model's: the input processor
says so once at start (engine/input_processor.py). Served dummy weights with a small tokenizer left
62 % of sampled ids without text, which read as a slow tail (BENCHMARKS.md, 2026-12-05)."""

from __future__ import annotations

import logging

from tokenizers import Tokenizer, models

from tokenmill.engine.input_processor import InputProcessor, tokenizer_coverage_warning
from tokenmill.engine.messages import EngineInfo


class _Sized:
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size


def _info(vocab_size: int) -> EngineInfo:
    return EngineInfo(
        max_model_len=64, num_kv_blocks=8, block_size=16, vocab_size=vocab_size, max_num_seqs=4,
        max_num_batched_tokens=64, device="cpu", dtype="float32",
    )  # fmt: skip


def test_padded_vocabularies_pass_and_other_models_tokenizers_are_named() -> None:
    assert tokenizer_coverage_warning(_Sized(151_665), 151_936) is None  # Qwen2.5's padding
    assert tokenizer_coverage_warning(_Sized(32_011), 32_064) is None  # Phi-3's
    assert tokenizer_coverage_warning(None, 128_256) is None  # token ids only: nothing decodes
    warning = tokenizer_coverage_warning(_Sized(49_152), 128_256)
    assert warning is not None and "49,152 ids" in warning and "128,256" in warning and "79,104 ids" in warning
    assert "--tokenizer" in warning


def test_the_input_processor_logs_it_once_at_start(caplog) -> None:
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0"))
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    with caplog.at_level(logging.WARNING, logger="tokenmill.engine.input_processor"):
        InputProcessor(fast, _info(10), [0])
        assert caplog.records == []
        InputProcessor(fast, _info(100), [0])
    assert [r.getMessage()[:40] for r in caplog.records] == ["the tokenizer has 10 ids but the model s"]
