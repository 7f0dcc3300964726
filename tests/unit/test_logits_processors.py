"""logit_bias, allowed_token_ids and bad words in the sampler; their validation; the bad-words helper."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.input_processor import InputProcessor, bad_words_to_token_ids
from tokenmill.engine.messages import EngineInfo
from tokenmill.errors import InvalidRequestError
from tokenmill.sample.logits_processors import bad_word_bans
from tokenmill.sample.metadata import RowSamplingInfo, SamplingMetadata, make_generator
from tokenmill.sample.sampler import Sampler
from tokenmill.sampling_params import SamplingParams

VOCAB = 50


def row(output=(), generator=None, **params) -> RowSamplingInfo:
    return RowSamplingInfo(SamplingParams(**params), [1, 2, 3], list(output), generator)


def sample(logits: torch.Tensor, rows: list[RowSamplingInfo]) -> list[int]:
    md = SamplingMetadata.build(rows, logits.device, logits.shape[-1])
    return Sampler()(logits, md).sampled_token_ids.tolist()


def random_logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


# --- logit_bias --------------------------------------------------------------------------------


def test_plus_100_bias_makes_greedy_pick_the_token_and_minus_100_bans_the_argmax():
    logits = random_logits(2)
    top = logits.argmax(dim=-1).tolist()
    target = (top[0] + 7) % VOCAB
    got = sample(logits, [row(temperature=0.0, logit_bias={target: 100.0}), row(temperature=0.0, logit_bias={top[1]: -100.0})])
    assert got[0] == target
    assert got[1] != top[1]
    assert got[1] == logits[1].clone().index_fill_(0, torch.tensor([top[1]]), -1e9).argmax().item()


def test_bias_applies_to_random_rows_and_string_keys_are_token_ids():
    logits = random_logits(4)
    rows = [row(temperature=1.0, logit_bias={"11": 100}, generator=make_generator(i, "cpu")) for i in range(4)]
    assert sample(logits, rows) == [11, 11, 11, 11]


def test_bias_leaves_the_callers_logits_and_the_raw_logprobs_alone():
    logits = random_logits(1)
    before = logits.clone()
    md = SamplingMetadata.build([row(temperature=0.0, logit_bias={5: 100.0}, logprobs=1)], "cpu", VOCAB)
    out = Sampler()(logits, md)
    assert torch.equal(logits, before)
    assert out.sampled_token_ids.item() == 5
    raw = torch.log_softmax(before, dim=-1)[0, 5].item()
    assert out.logprobs[0, 0].item() == pytest.approx(raw, abs=1e-5)


# --- allowed_token_ids -------------------------------------------------------------------------


def test_allowed_token_ids_restrict_every_sample_at_temperature_1():
    allowed = [3, 17, 42]
    logits = random_logits(8, seed=1)
    rows = [row(temperature=1.0, allowed_token_ids=allowed, generator=make_generator(i, "cpu")) for i in range(8)]
    for step in range(20):
        got = sample(logits + step, rows)
        assert set(got) <= set(allowed)


def test_allowed_token_ids_on_a_greedy_row_pick_the_best_allowed():
    logits = random_logits(1, seed=2)
    allowed = [0, 9, 33]
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert sample(logits, [row(temperature=0.0, allowed_token_ids=allowed)]) == [best]


# --- bad words ---------------------------------------------------------------------------------


def test_bad_word_bans_follow_vllms_prefix_rule():
    words = [[7], [4, 5], [1, 2, 3]]
    assert bad_word_bans(words, []) == {7}  # only single-token words can bite before any output
    assert bad_word_bans(words, [9, 4]) == {7, 5}
    assert bad_word_bans(words, [1, 2]) == {7, 3}
    assert bad_word_bans(words, [2, 1]) == {7}


def test_bad_words_ban_the_completing_token_only_after_the_prefix():
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 10.0
    logits[:, 6] = 5.0
    rows = [
        row(temperature=0.0, output=[4], bad_words_token_ids=[[4, 5]]),  # prefix present: 5 banned
        row(temperature=0.0, output=[3], bad_words_token_ids=[[4, 5]]),  # prefix absent: 5 allowed
    ]
    assert sample(logits, rows) == [6, 5]
    assert sample(logits[:1], [row(temperature=0.0, bad_words_token_ids=[[5]])]) == [6]


# --- batching with plain rows ------------------------------------------------------------------


def test_rows_without_processors_sample_as_if_alone():
    logits = random_logits(4, seed=3)
    plain = logits.argmax(dim=-1).tolist()
    rows = [
        row(temperature=0.0),
        row(temperature=0.0, logit_bias={1: 100.0}),
        row(temperature=0.0),
        row(temperature=0.0, allowed_token_ids=[2], bad_words_token_ids=[[3]]),
    ]
    got = sample(logits, rows)
    assert got[0] == plain[0] and got[2] == plain[2]
    assert got[1] == 1 and got[3] == 2


def test_processor_flags():
    assert SamplingParams(temperature=0.0).is_plain_greedy
    for kwargs in ({"logit_bias": {1: 1.0}}, {"allowed_token_ids": [1]}, {"bad_words_token_ids": [[1]]}):
        params = SamplingParams(temperature=0.0, **kwargs)
        assert params.has_logits_processors and not params.is_plain_greedy
    assert SamplingParams(bad_words_token_ids=[[1, 2]]).needs_output_history
    assert SamplingParams(bad_words=["x"]).needs_output_history


# --- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: -101}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {1: "x"}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [[1, -1]]}, "bad_words_token_ids"),
        ({"bad_words_token_ids": [1, 2]}, "bad_words_token_ids"),
        ({"bad_words": ["ok", "  "]}, "bad_words"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field
    assert field in str(info.value)


def test_bias_bounds_are_inclusive():
    SamplingParams(logit_bias={0: 100, 1: -100.0})


def _processor(tokenizer=None, vocab_size: int = VOCAB) -> InputProcessor:
    info = EngineInfo(
        max_model_len=128,
        num_kv_blocks=64,
        block_size=16,
        vocab_size=vocab_size,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        device="cpu",
        dtype="float32",
    )
    return InputProcessor(tokenizer, info, [0])


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [1, VOCAB]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1, VOCAB + 3]]}, "bad_words_token_ids"),
    ],
)
def test_token_ids_beyond_the_vocab_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        _processor().make_request("r", [1, 2], SamplingParams(**kwargs))
    assert info.value.param == field


# --- bad words as text -------------------------------------------------------------------------


def test_bad_words_helper_gives_the_word_with_and_without_a_leading_space(tiny_tokenizer):
    words = bad_words_to_token_ids(tiny_tokenizer, ["hello", " world"])
    encode = lambda text: tiny_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert encode("hello") in words and encode("world") in words
    for text in (" hello", " world"):
        spaced = encode(text)
        bare = encode(text.strip())
        assert (spaced in words) == (spaced[0] != bare[0] and len(spaced) == len(bare))


def test_make_request_tokenizes_bad_words(tiny_tokenizer):
    processor = _processor(tiny_tokenizer, vocab_size=len(tiny_tokenizer))
    params = SamplingParams(bad_words=["paris"], bad_words_token_ids=[[5]])
    req = processor.make_request("r", [1, 2], params)
    assert req.sampling_params.bad_words is None
    assert req.sampling_params.bad_words_token_ids == [[5], *bad_words_to_token_ids(tiny_tokenizer, ["paris"])]
    with pytest.raises(InvalidRequestError) as info:
        _processor(None).make_request("r", [1, 2], SamplingParams(bad_words=["paris"]))
    assert info.value.param == "bad_words"


# --- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_processors_match_the_cpu_and_never_sync():
    logits = random_logits(4, seed=4)
    rows = [
        row(temperature=0.0, logit_bias={3: 100.0, 4: -5.0}),
        row(temperature=0.0, allowed_token_ids=[9, 10, 11]),
        row(temperature=0.0, output=[7, 8], bad_words_token_ids=[[8, 1], [2]]),
        row(temperature=0.0),
    ]
    expected = sample(logits, rows)
    device = torch.device("cuda")
    on_device = logits.to(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md = SamplingMetadata.build(rows, device, VOCAB)
        out = Sampler()(on_device, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.tolist() == expected
