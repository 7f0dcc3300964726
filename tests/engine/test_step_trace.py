"""The engine's trace (--trace-dir, engine/step_trace.py): one record per step in steps.jsonl and a
timeline on each request's final output, with and without async scheduling; tracing changes no
token."""

from __future__ import annotations

import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.messages import EngineCoreRequest

PROMPT_LENS = (37, 5, 70, 12)


def _prompts() -> list[list[int]]:
    return [[(13 * i + 7 * j) % 800 + 40 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]


def _run(core, prompts: list[list[int]], max_tokens: int) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, max_tokens=max_tokens))
    finals, tokens = {}, {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out
    return [finals[f"r{i}"] for i in range(len(prompts))], [tokens[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_steps_and_request_timelines(tiny_llama_dir, tmp_path, async_scheduling):
    trace = tmp_path / "trace"
    llm = LLM(
        str(tiny_llama_dir), device="cpu", max_model_len=128, max_num_batched_tokens=32,
        async_scheduling=async_scheduling, enable_prefix_caching=False, trace_dir=str(trace),
    )  # fmt: skip
    finals, tokens = _run(llm.engine, _prompts(), max_tokens=6)
    llm.engine.flush_trace()
    steps = [json.loads(line) for line in (trace / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(len(steps)))
    for s in steps:
        assert s["start"] <= s["scheduled"] <= s["launched"] <= s["done"]
        assert 1 <= s["tokens"] <= 32 and s["reqs"] >= 1 and s["graph"] == 0
        assert s["compiles"] == []  # no Triton on the CPU path
    # Every prompt token and every decode is computed in exactly one step.
    assert sum(s["tokens"] for s in steps) == sum(PROMPT_LENS) + len(PROMPT_LENS) * 5
    assert sum(s["new_reqs"] for s in steps) == len(PROMPT_LENS)
    by_step = {s["step"]: s for s in steps}
    for prompt_len, final, out_tokens in zip(PROMPT_LENS, finals, tokens, strict=True):
        timeline = final.timeline
        assert timeline is not None and len(out_tokens) == 6
        assert timeline.prompt_tokens == prompt_len
        assert sum(chunk[2] for chunk in timeline.prefill_chunks) == prompt_len  # budget 32: chunked
        assert len(timeline.prefill_chunks) >= -(-prompt_len // 32)  # the budget is shared
        assert timeline.arrival <= timeline.received <= timeline.prefill_chunks[0][0]
        assert timeline.prefill_chunks[-1][0] <= timeline.first_token <= timeline.finished
        first_chunk_step = by_step[timeline.prefill_chunks[0][1]]
        assert first_chunk_step["prefill_tokens"] >= timeline.prefill_chunks[0][2] or prompt_len == 1
        assert timeline.num_steps == len(timeline.prefill_chunks) + 5  # the first token comes with the prompt
        assert timeline.preempted == []


def test_tracing_changes_no_token(tiny_llama_dir, tmp_path):
    def greedy(**kwargs) -> list:
        llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, max_num_batched_tokens=32, **kwargs)
        return _run(llm.engine, _prompts(), max_tokens=8)[1]

    assert greedy(trace_dir=str(tmp_path / "t")) == greedy()


def test_a_trace_dir_that_cannot_be_written_is_refused_naming_the_option(tiny_llama_dir, tmp_path):
    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    bad = str(blocker / "trace")
    with pytest.raises(ValueError, match="--trace-dir .* cannot hold the trace"):
        LLM(str(tiny_llama_dir), device="cpu", max_model_len=64, trace_dir=bad)
    with pytest.raises(ValueError, match="--trace-dir .* cannot hold the trace"):
        AsyncEngine(EngineConfig(trace_dir=bad))  # the API server's half, before any engine starts


def test_request_timelines_and_iteration_tokens_without_a_trace_dir(tiny_llama_dir, tmp_path, monkeypatch):
    """The engine keeps every request's timeline (the dashboard's slowest requests) and the tokens
    per step histogram with tracing off (the API server's OTLP spans are made of those timelines),
    and writes no step records."""
    monkeypatch.chdir(tmp_path)
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, max_num_batched_tokens=32, enable_prefix_caching=False)
    assert llm.engine.tracer is None
    finals, tokens = _run(llm.engine, _prompts(), max_tokens=4)
    for prompt_len, final, out_tokens in zip(PROMPT_LENS, finals, tokens, strict=True):
        timeline = final.timeline
        assert timeline is not None and timeline.output_tokens == len(out_tokens) == 4
        assert sum(chunk[2] for chunk in timeline.prefill_chunks) == prompt_len
        assert timeline.arrival <= timeline.received <= timeline.prefill_chunks[0][0] <= timeline.first_token <= timeline.finished
    assert len(llm.engine.timelines) == 0  # finished requests are forgotten
    stats = llm.engine.get_stats()
    assert stats["iteration_tokens_total_sum"] == sum(PROMPT_LENS) + len(PROMPT_LENS) * 3
    assert stats["iteration_tokens_total_bucket_le_32.0"] == stats["iteration_tokens_total_count"] >= 1
    llm.engine.flush_trace()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_constrained_steps_record_when_their_masked_sampling_launched(tiny_llama_dir, tmp_path, async_scheduling):
    from tokenmill.sampling_params import StructuredOutputsParams

    trace = tmp_path / "trace"
    llm = LLM(
        str(tiny_llama_dir), device="cpu", max_model_len=128, async_scheduling=async_scheduling,
        trace_dir=str(trace),
    )  # fmt: skip
    plain = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(["hello world"], plain)  # plain steps only
    constrained = SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["red", "green"])
    )
    llm.generate(["pick a colour", "another one"], constrained)
    llm.engine.flush_trace()
    steps = [json.loads(line) for line in (trace / "steps.jsonl").read_text().splitlines()]
    sampled = [s for s in steps if s["sampled"]]
    assert sampled and len(sampled) < len(steps)
    for s in steps[:4]:  # the plain request's steps sample with their forward
        assert s["sampled"] == 0.0 and s["mask_wait"] == 0.0
    for s in sampled:
        assert s["scheduled"] <= s["sampled"] <= s["done"]
        if async_scheduling:  # synchronous steps count as launched when done
            assert s["launched"] <= s["sampled"]
        assert 0.0 <= s["mask_wait"] <= s["sampled"] - s["start"]
