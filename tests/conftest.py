"""Tiny random checkpoints written with transformers, and the default model.

Every tiny model shares one real tokenizer: a byte-level BPE (about 1000 tokens) trained here
on a fixed text, with ChatML special tokens (<|endoftext|> = 0, <|im_start|> = 1,
<|im_end|> = 2 = EOS) and a ChatML chat template, so engine tests can tokenize any text
(byte-level: every UTF-8 string encodes) and apply a chat template.

Weights are drawn with a larger spread than transformers' init so logits are well separated
and greedy decoding does not hinge on float rounding; norms and biases are random too, so a
loader that drops them fails the equivalence tests.

| fixture          | family  | what it exercises                                                    |
| tiny_llama_dir   | llama   | tied embeddings, Llama-3 RoPE scaling (all three frequency bands)    |
| tiny_qwen2_dir   | qwen2   | q/k/v bias, untied lm_head, sharded safetensors with an index.json   |
| tiny_qwen3_dir   | qwen3   | Q/K RMSNorm, head_dim (32) != hidden / heads (16)                    |
| tiny_mistral_dir | mistral | plain GQA without sliding window                                     |

All: hidden 64, 2 layers, 4 heads, 2 KV heads, fp32, max_position_embeddings 512.

`paced_llama_dir` is the odd one out: hidden 512, 8 layers (~30 M parameters), so a decode step
takes ~10 ms on the 2-core CPU instead of ~1 ms. Server tests that need a request still in flight
when something happens (a deadline, a killed or stopped engine, a drain) use it: the tiny models
finish a few hundred tokens before a 0.3 s deadline or a signal lands.
"""

from __future__ import annotations

import gc
import os
import random
from pathlib import Path

import pytest
import torch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_WORD_TEXT = (
    "the of and to in is was that for on with as by at from this be are or an it not which have "
    "one all were when we there can more if out so what up about into than them only some could "
    "time model token cache block page attention request batch stream server engine prefix decode "
    "prefill kernel python tensor layer weight vector matrix memory scheduler sample greedy answer "
    "question hello world paris france capital river mountain ocean forest city village garden "
    "number zero seven eleven hundred thousand million first second third quick brown fox jumps "
    "over lazy dog café naïve résumé über straße 東京 北京 日本語 中文 привет мир 😀 🚀 ✨ "
    "def return import class self print while else elif yield lambda async await"
)
_WORDS = _WORD_TEXT.split()


def _training_text() -> list[str]:
    rng = random.Random(1234)
    lines = []
    for _ in range(3000):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 99999)))
        lines.append(" ".join(words) + rng.choice([".", ",", "!", "?", ":", "\n"]))
    return lines


def build_tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_training_text(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
    )


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(torch.empty_like(param).uniform_(0.7, 1.3, generator=gen))
        elif name.endswith("bias"):
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
        elif "embed_tokens" in name or "lm_head" in name:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.25)
        else:
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def write_tiny_checkpoint(path: Path, family: str, tokenizer, seed: int, **overrides) -> Path:
    """Write a tiny random `family` checkpoint + tokenizer to `path` with save_pretrained."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    shard_size = kwargs.pop("max_shard_size", None)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).to(torch.float32).eval()
    _randomize(model, seed)
    save_kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


# Llama-3 RoPE scaling small enough that all three frequency bands occur in a tiny model.
TINY_LLAMA_ROPE_SCALING = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    rope = dict(TINY_LLAMA_ROPE_SCALING)
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_llama"),
        "llama",
        tiny_tokenizer,
        seed=1,
        tie_word_embeddings=True,
        head_dim=16,
        rope_parameters=rope,
    )


@pytest.fixture(scope="session")
def paced_llama_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("paced_llama"),
        "llama",
        tiny_tokenizer,
        seed=5,
        tie_word_embeddings=True,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tiny_tokenizer, seed=2, max_shard_size="200KB"
    )


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_qwen3"), "qwen3", tiny_tokenizer, seed=3, head_dim=32
    )


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_mistral"),
        "mistral",
        tiny_tokenizer,
        seed=4,
        head_dim=16,
        sliding_window=None,
    )


# The CPU's default KV pool (kv_cache_memory unset, no num_kv_blocks) is 1 GiB, zero-filled at every
# engine start: ~0.65 s of page faults and memset per LLM, over the hundreds of in-process engines
# the suite builds (the 1 GiB pools were most of its ~300 s of system time). Tests of the pool's own
# size set kv_cache_memory / num_kv_blocks explicitly; everywhere else 256 MiB is far more than any
# test's requests hold (~5.7K tokens of the default model in fp32, over 100K of a tiny one).
# Engines in other processes (served models, TP workers) keep the real default.
TEST_DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20


@pytest.fixture(scope="session", autouse=True)
def _smaller_default_cpu_kv_pool():
    from tokenmill.worker import kv_cache

    real = kv_cache.DEFAULT_CPU_KV_CACHE_BYTES
    kv_cache.DEFAULT_CPU_KV_CACHE_BYTES = TEST_DEFAULT_CPU_KV_CACHE_BYTES
    yield
    kv_cache.DEFAULT_CPU_KV_CACHE_BYTES = real


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The default model's .gguf (SmolLM2-135M-Instruct Q4_1), fetched into $TOKENMILL_CACHE once."""
    from tokenmill.model.loader.default_model import default_model_path as fetch

    return fetch()


def pytest_collection_finish(session: pytest.Session) -> None:
    from tests.triton_interpreter import start_interpreted_runs

    start_interpreted_runs(session)  # in the background, while the other tests run


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.triton_interpreter import stop_interpreted_runs

    stop_interpreted_runs()


# An engine used to sit in reference cycles (EngineCore <-> its structured-output manager's bound
# method, a drafter <-> its runner, the free-block list's links), so it outlived its test until the
# cyclic garbage collector happened to run a full pass; on the CPU each holds a zero-filled 1 GiB KV
# pool, and the suite's process grew to 7-9 GB that way. Those cycles are gone (a dropped LLM is
# freed at once: tests/engine/test_llm_close.py), but a test can still make its own (a traceback
# kept in a frame that holds an LLM), so this stays as a safety net. A full collection costs
# ~0.25 s, too much after each of ~2500 tests: one runs after a test only when the process has
# grown by _COLLECT_AFTER_GROWTH over the smallest size seen since the last one.
_COLLECT_AFTER_GROWTH = 1536 << 20
_rss_floor: list[int] = []


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, AttributeError, ValueError):  # not Linux: no check
        return 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    result = yield  # after the test's fixtures (and a module's, after its last test) are torn down
    rss = _rss()
    if _rss_floor and rss > _rss_floor[0] + _COLLECT_AFTER_GROWTH:
        gc.collect()
        _rss_floor[:] = [_rss()]
    else:
        _rss_floor[:] = [min(_rss_floor + [rss])]
    return result
