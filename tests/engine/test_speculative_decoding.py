"""Speculative decoding in the engine: greedy output identical with it on and off for every
method, under batching, chunked prefill, preemption and prefix caching; a drafter identical to the
target accepts everything; aborts mid-verification leak nothing."""

from __future__ import annotations

import json
import re

import pytest

from tests.engine.hf_oracle import hf_greedy
from tokenmill import LLM, SamplingParams
from tokenmill.sampling_params import StructuredOutputsParams as SO

K = 3


def _prompts(n: int, length: int = 20) -> list[list[int]]:
    # Short repeating patterns: the tiny random model's output repeats too, so n-grams match.
    return [[(7 * i + (j % 5)) % 900 + 50 for j in range(length + i)] for i in range(n)]


def _spec(method: str, model_dir) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K}
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": K}


def _llm(model_dir, speculative_config=None, **overrides) -> LLM:
    options = dict(device="cpu", max_model_len=128, block_size=4) | overrides
    return LLM(str(model_dir), speculative_config=speculative_config, **options)


def _tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def _run(llm: LLM, prompts, params) -> list:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert not llm.engine.has_work()
    llm.engine.check_invariants()
    assert llm.engine.get_stats()["kv_cache_usage"] == 0.0, "a KV block outlived its request"
    return outputs


@pytest.fixture(scope="module")
def baseline(tiny_llama_dir) -> LLM:
    return _llm(tiny_llama_dir)


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def speculative(request, tiny_llama_dir) -> LLM:
    return _llm(tiny_llama_dir, _spec(request.param, tiny_llama_dir))


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_greedy_output_is_unchanged_in_a_batch(baseline, speculative):
    prompts = _prompts(6)
    before = speculative.engine.get_stats()
    assert _tokens(_run(speculative, prompts, GREEDY)) == _tokens(_run(baseline, prompts, GREEDY))
    after = speculative.engine.get_stats()
    # It really speculated: drafts were verified and some accepted.
    assert after["spec_decode_num_drafts"] > before["spec_decode_num_drafts"]
    assert after["spec_decode_num_accepted_tokens"] > before["spec_decode_num_accepted_tokens"]


def test_greedy_output_matches_transformers(speculative, tiny_llama_dir):
    prompt = _prompts(1)[0]
    expected, _ = hf_greedy(str(tiny_llama_dir), prompt, 16)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert _tokens(_run(speculative, [prompt], params))[0] == expected


def test_stops_inside_an_accepted_run_cut_it_exactly(baseline, speculative):
    prompts = _prompts(4)
    reference = _tokens(_run(baseline, prompts, GREEDY))
    # A stop token a few tokens in (drafts usually run past it), a max_tokens not on a step boundary.
    stop = reference[0][5]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop]),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
    ):
        on = _run(speculative, prompts, params)
        off = _run(baseline, prompts, params)
        assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in on] == [
            (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in off
        ]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_chunked_prefill_preemption_and_prefix_caching_keep_greedy_output(method, tiny_llama_dir, baseline):
    # A small step budget chunks the prompts; a small pool preempts; a shared prefix hits the cache.
    shared = [(3 * j) % 700 + 40 for j in range(24)]
    prompts = [shared + p for p in _prompts(5, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = _tokens(_run(baseline, prompts, params))
    llm = _llm(
        tiny_llama_dir, _spec(method, tiny_llama_dir), max_num_batched_tokens=16, num_kv_blocks=24, max_model_len=80,
    )  # fmt: skip
    assert _tokens(_run(llm, prompts, params)) == expected
    stats = llm.engine.get_stats()
    assert stats["num_preemptions_total"] > 0, "the pool was meant to be too small for all five at once"
    assert stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0


def test_a_drafter_identical_to_the_target_accepts_every_draft(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, _spec("draft_model", tiny_llama_dir))
    # 1 token from the prefill, then steps of k + 1: no step is cut short by max_tokens.
    params = SamplingParams(temperature=0.0, max_tokens=1 + 5 * (K + 1), ignore_eos=True)
    _run(llm, _prompts(3), params)
    stats = llm.engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] == 3 * 5 * K
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    mean_length = 1 + stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_drafts"]
    assert mean_length == K + 1
    assert [stats[f"spec_decode_num_accepted_tokens_per_pos.{i}"] for i in range(K)] == [15.0] * K


def test_seeded_sampling_is_reproducible_and_logprobs_match(baseline, speculative):
    prompts = _prompts(3)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    assert _tokens(_run(speculative, prompts, seeded)) == _tokens(_run(speculative, prompts, seeded))
    # Logprobs of the accepted tokens are the target's, as without speculation.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    on, off = _run(speculative, prompts, params), _run(baseline, prompts, params)
    for a, b in zip(on, off, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert lp_a[token].logprob == pytest.approx(lp_b[token].logprob, abs=1e-4)


def test_requests_that_read_their_history_get_no_drafts_and_keep_their_output(baseline, speculative):
    prompts = _prompts(2)
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, ignore_eos=True)
    before = speculative.engine.get_stats()["spec_decode_num_drafts"]
    assert _tokens(_run(speculative, prompts, params)) == _tokens(_run(baseline, prompts, params))
    assert speculative.engine.get_stats()["spec_decode_num_drafts"] == before


def test_aborts_mid_verification_free_everything_and_disturb_no_one(speculative, baseline):
    prompts = _prompts(4)
    expected = _tokens(_run(baseline, prompts, GREEDY))
    engine = speculative.engine
    processor = speculative.input_processor
    for i, prompt in enumerate(prompts):
        engine.add_request(processor.make_request(f"abort-{i}", prompt, GREEDY))
    tokens: dict[str, list[int]] = {f"abort-{i}": [] for i in range(len(prompts))}
    aborted_mid_verification = False
    steps = 0
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        steps += 1
        if steps == 4:
            live = engine.scheduler.requests
            aborted_mid_verification = any(live[rid].spec_token_ids for rid in ("abort-1", "abort-3"))
            engine.abort_requests(["abort-1", "abort-3"])
        engine.check_invariants()
    assert aborted_mid_verification, "the aborted requests were meant to hold drafts"
    assert tokens["abort-0"] == expected[0] and tokens["abort-2"] == expected[2]
    assert engine.get_stats()["kv_cache_usage"] == 0.0


def test_structured_output_masks_every_draft_position(default_model_path):
    """Constrained requests verify drafts too (a mask row per draft position): greedy output is the
    one without speculation, sampled output always matches its grammar, and drafts were verified."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 4},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    regex = r"(ab|cd){3,6}-[0-9]{2}"
    base = LLM(None, device="cpu", max_model_len=512, seed=0)
    spec = LLM(
        None, device="cpu", max_model_len=512, seed=0,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )  # fmt: skip
    prompts = ["A person as JSON: {\"name\": \"Ann\", \"tags\": [\"a\", \"b\"]}. Another one:", "Code:"]
    json_spec = SO(json=schema, disable_any_whitespace=True)
    greedy = [
        SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=json_spec),
        SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=SO(regex=regex)),
    ]
    expected = [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)]
    got = spec.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
    json.loads(got[0].outputs[0].text)
    assert re.fullmatch(regex, got[1].outputs[0].text)
    sampled = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=30, structured_outputs=SO(regex=regex)) for s in range(6)
    ]
    for out in spec.generate(["Code:"] * 6, sampled, use_tqdm=False):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop" and re.fullmatch(regex, text), text
    stats = spec.engine.get_stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    spec.engine.check_invariants()
    assert stats["kv_cache_usage"] == 0.0


def test_large_batches_overlap_steps_and_small_ones_draft(tiny_llama_dir, baseline):
    """With async scheduling on, a batch above disable_by_batch_size drafts nothing and overlaps
    its steps; as requests finish it drafts again. Greedy output stays unchanged throughout."""
    spec = {"method": "ngram", "num_speculative_tokens": K, "disable_by_batch_size": 2}
    llm = _llm(tiny_llama_dir, spec, async_scheduling=True)
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(6)]
    expected = _tokens(_run(baseline, prompts, params))
    engine = llm.engine
    overlapped = drafted_alone = 0
    requests = [llm.input_processor.make_request(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        overlapped += engine._in_flight is not None
        drafted_alone += engine.scheduler.num_running <= 2 and engine.get_stats()["spec_decode_num_drafts"] > 0
        engine.check_invariants()
    assert [tokens[f"r{i}"] for i in range(6)] == expected
    assert overlapped > 0 and drafted_alone > 0
    assert engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
