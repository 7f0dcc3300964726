"""logit_bias, allowed_token_ids and bad words end to end: LLM on a tiny random checkpoint."""

from __future__ import annotations

import pytest

from tokenmill.engine.input_processor import bad_words_to_token_ids
from tokenmill.engine.llm import LLM
from tokenmill.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 17, 33, 8]}, {"prompt_token_ids": [40, 2, 99, 71, 12]}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=128)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def tokens(llm: LLM, params: list[SamplingParams], prompts=PROMPTS) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def contains(sequence: list[int], word: list[int]) -> bool:
    return any(sequence[i : i + len(word)] == word for i in range(len(sequence) - len(word) + 1))


@pytest.fixture(scope="module")
def baseline(llm) -> list[list[int]]:
    return tokens(llm, [greedy(), greedy()])


def test_plus_100_bias_forces_a_token_and_the_plain_request_beside_it_is_unchanged(llm, baseline):
    target = 123
    got = tokens(llm, [greedy(), greedy(logit_bias={target: 100.0})])
    assert got[0] == baseline[0]
    assert got[1] == [target] * MAX_TOKENS


def test_minus_100_bias_bans_the_greedy_choice(llm, baseline):
    first = baseline[0][0]
    got = tokens(llm, [greedy(logit_bias={first: -100.0}), greedy()])
    assert got[0][0] != first
    assert got[1] == baseline[1]


def test_allowed_token_ids_restrict_every_sampled_token_at_temperature_1(llm, baseline):
    allowed = [7, 100, 250, 600]
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3, allowed_token_ids=allowed)
    got = tokens(llm, [sampled, greedy()])
    assert set(got[0]) <= set(allowed)
    assert got[1] == baseline[1]


def test_bad_words_never_appear_single_and_multi_token(llm, baseline):
    single = [baseline[0][0]]
    pair = baseline[1][2:4]
    prompts = [*PROMPTS, PROMPTS[0]]
    got = tokens(llm, [greedy(bad_words_token_ids=[single]), greedy(bad_words_token_ids=[pair]), greedy()], prompts)
    assert single[0] not in got[0]
    assert not contains(got[1], pair)
    assert got[1][:2] == baseline[1][:2]  # the ban bites only once its prefix was generated
    assert got[2] == baseline[0]


def test_bad_words_as_text_are_tokenized_by_the_llm(llm):
    prompt = [{"prompt": "the quick brown fox"}]
    [plain] = tokens(llm, [greedy()], prompt)
    word = llm.tokenizer.decode(plain[:2]).strip()
    if not word:
        pytest.skip("the greedy continuation starts with whitespace only")
    [got] = tokens(llm, [greedy(bad_words=[word])], prompt)
    for bad in bad_words_to_token_ids(llm.tokenizer, [word]):
        assert not contains(got, bad)
