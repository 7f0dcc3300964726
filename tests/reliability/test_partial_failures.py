"""One sequence of a request failing while its siblings run, and the engine dying mid-request: what
each client gets, and that the server keeps nothing of those requests afterwards. The real HTTP
stack (uvicorn on loopback) over the scripted FakeEngine.

A request's sequences (n choices of each prompt) share one HTTP response. When one ends with
finish_reason "error", a stream ends that choice with an error event and goes on with the others. A
non-streaming response cannot carry both an error and choices in OpenAI's shape: it is the error,
with the status, type and param the stream's event has (400 when the request itself can never run,
500 when the model failed on it), and the other sequences are aborted at once instead of being
generated for a response that will never carry them.
"""

from __future__ import annotations

import asyncio

from tests.reliability.fake_server import FakeServer, assert_openai_error, run, sse_json
from tests.server.fake_engine import wait_until
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.outputs import ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.messages import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.admission import AdmissionControl
from tokenmill.server.serving_common import sequence_error

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# What the model runner reports for a sequence whose logits went NaN (worker/model_runner.py).
NAN = "the model produced non-finite (NaN or inf) logits for this request"


def engine_error_messages() -> dict[str, str]:
    """The errors the real scheduler ends a request with when the request itself can never run."""
    messages = {}
    for name, (num_blocks, max_model_len, num_prompt_tokens) in {
        "pool": (4, 256, 17),  # 17 tokens need 5 blocks of 4; the pool has 4
        "max_model_len": (64, 16, 17),
    }.items():
        scheduler = Scheduler(
            SchedulerConfig(8, 64, "fcfs", max_model_len),  # type: ignore[arg-type]
            CacheConfig(block_size=4),
            num_blocks,
        )
        prompt = list(range(1, num_prompt_tokens + 1))
        scheduler.add_request(Request(name, prompt, SamplingParams(max_tokens=2), eos_token_ids=()))
        [out] = scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput())
        assert out.finish_reason == "error" and out.error, out
        messages[name] = out.error
    return messages


def fail_choice(suffix: str, message: str, after_tokens: int = 3):
    """A FakeCore.fail_when ending the engine sequences whose id ends with `suffix` (`-p0-1`:
    prompt 0, choice 1) after `after_tokens` tokens."""

    def fail_when(request: EngineCoreRequest, num_generated: int) -> str | None:
        return message if request.request_id.endswith(suffix) and num_generated == after_tokens else None

    return fail_when


def sibling_ids(fs: FakeServer, failed_suffix: str) -> list[str]:
    return sorted(rid for rid in fs.engine.core.added if not rid.endswith(failed_suffix))


def error_events(chunks: list[dict]) -> list[dict]:
    return [c["error"] for c in chunks if "error" in c]


def finish_reasons(chunks: list[dict]) -> dict[int, str]:
    return {
        c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
        for c in chunks
        if c.get("choices") and c["choices"][0].get("finish_reason")
    }


def assert_nothing_kept(fs: FakeServer) -> None:
    """Nothing of the finished requests stays in the server: no per-sequence state in the engine
    client or its output processor, no admission, no inter-token-latency clock."""
    assert fs.engine.num_unfinished == 0
    assert not fs.engine.output_processor.states  # type: ignore[union-attr]
    assert (fs.state.admission.num_waiting_seqs, fs.state.admission.num_waiting_tokens) == (0, 0)
    assert fs.state._token_clock == {}, fs.state._token_clock


# --------------------------------------------------------------------------- one sequence fails


def test_a_failing_choice_fails_a_non_streaming_request_with_the_streams_status_and_aborts_the_rest():
    async def scenario(fs: FakeServer) -> None:
        fs.engine.core.fail_when = fail_choice("-p0-1", NAN)
        body = {"prompt": "hi", "n": 3, "max_tokens": 60, "ignore_eos": True}

        # Streaming: only choice 1 ends, with an error event just before its finish chunk.
        chunks = sse_json((await fs.client.post(COMPLETIONS, json={**body, "stream": True})).text)
        [event] = error_events(chunks)
        assert (event["code"], event["type"], event["param"]) == (500, "internal_error", None)
        assert "choice 1" in event["message"] and NAN in event["message"], event
        assert finish_reasons(chunks) == {0: "length", 1: "error", 2: "length"}
        assert_nothing_kept(fs)

        # Non-streaming: the same status, type and message, as OpenAI's error body, at once: the
        # other two choices are aborted in the engine, not generated to the end and thrown away.
        fs.engine.core.added.clear()
        r = await fs.client.post(COMPLETIONS, json=body)
        error = assert_openai_error(r, 500)
        assert error["type"] == "internal_error" and error["message"].startswith(event["message"]), error
        assert "2 other choices" in error["message"], error
        siblings = sibling_ids(fs, "-p0-1")
        assert len(siblings) == 2
        await wait_until(lambda: sorted(fs.engine.core.aborted[-2:]) == siblings)
        assert_nothing_kept(fs)

        # Chat, and the index of a choice of the second prompt of a completion (i * n + j).
        r = await fs.client.post(CHAT, json={"messages": [{"role": "user", "content": "hi"}], **body})
        assert "choice 1" in assert_openai_error(r, 500)["message"]
        fs.engine.core.fail_when = fail_choice("-p1-0", NAN)
        r = await fs.client.post(COMPLETIONS, json={**body, "prompt": ["a", "b"], "n": 2})
        assert "choice 2 " in assert_openai_error(r, 500)["message"]
        assert not fs.engine.core.running
        assert_nothing_kept(fs)
        assert (await fs.client.get("/health")).status_code == 200

    run(scenario, serve_http=True, step_s=0.005)


def test_a_request_the_engine_can_never_run_is_a_400_naming_the_field_streaming_or_not():
    """The server refuses such requests before the engine sees them; should the engine still end one
    (its check and the server's disagree), the client learns that retrying cannot help: 400 with the
    field to change, not a 500 (which OpenAI's clients retry)."""
    pool_message = engine_error_messages()["pool"]

    async def scenario(fs: FakeServer) -> None:
        fs.engine.core.fail_when = fail_choice("-p0-0", pool_message, after_tokens=2)
        body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 30, "ignore_eos": True}
        r = await fs.client.post(CHAT, json=body)
        error = assert_openai_error(r, 400, "max_tokens")
        assert error["type"] == "invalid_request_error" and "choice 0" in error["message"]
        assert "whole pool" in error["message"]

        chunks = sse_json((await fs.client.post(CHAT, json={**body, "stream": True})).text)
        [event] = error_events(chunks)
        assert (event["code"], event["type"], event["param"]) == (400, "invalid_request_error", "max_tokens")
        assert finish_reasons(chunks) == {0: "error", 1: "length"}
        assert_nothing_kept(fs)

    run(scenario, serve_http=True, step_s=0.005)


def test_engine_errors_about_the_request_itself_are_400s_and_model_failures_500s():
    """The scheduler's own messages (not copies) classify as the request's fault, so rewording them
    cannot silently turn these 400s back into 500s."""
    messages = engine_error_messages()
    for name, param in (("pool", "max_tokens"), ("max_model_len", "prompt")):
        error = sequence_error(0, messages[name])
        assert (error.status_code, error.error_type, error.param) == (400, "invalid_request_error", param)
    for reason in (NAN, "model execution failed: RuntimeError: CUDA error", None):
        error = sequence_error(3, reason)
        assert (error.status_code, error.error_type, error.param) == (500, "internal_error", None)
        assert error.message.startswith("choice 3 failed: ")


# --------------------------------------------------------------------------- the engine dies


def test_engine_death_with_requests_in_flight_leaves_no_token_clock_entries():
    """Every sequence the engine had when it died — streaming or not, n > 1, several prompts,
    mid-generation or still queued — ends, and none leaves its inter-token-latency clock
    (ServerState._token_clock) behind: the clock only grows with live sequences."""

    async def scenario(fs: FakeServer) -> None:
        running = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "n": 2}
        bodies = [
            (COMPLETIONS, running),
            (COMPLETIONS, {**running, "stream": True}),
            (COMPLETIONS, {**running, "prompt": ["a", "b"], "n": 3}),
            (CHAT, {"messages": [{"role": "user", "content": "hi"}], **running, "stream": True}),
        ]
        tasks = [asyncio.create_task(fs.client.post(path, json=body)) for path, body in bodies]
        await wait_until(lambda: len(fs.state._token_clock) == 12)  # every sequence has tokens
        fs.engine.core.paused = True  # one more, still waiting for its first token
        tasks.append(asyncio.create_task(fs.client.post(COMPLETIONS, json=running)))
        await wait_until(lambda: len(fs.engine.core.added) == 14)
        fs.engine.client.mark_dead("the engine process exited with code -9")
        responses = await asyncio.gather(*tasks)
        for r, (_, body) in zip(responses, [*bodies, (COMPLETIONS, running)], strict=True):
            if body.get("stream"):
                assert r.status_code == 200 and error_events(sse_json(r.text))[-1]["code"] == 503
            else:
                assert_openai_error(r, 503)
        assert_nothing_kept(fs)

    run(scenario, serve_http=True, step_s=0.01)


def test_a_hung_engine_killed_with_requests_in_flight_leaves_no_token_clock_entries():
    async def scenario(fs: FakeServer) -> None:
        body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "n": 2}
        tasks = [
            asyncio.create_task(fs.client.post(COMPLETIONS, json=body)),
            asyncio.create_task(fs.client.post(COMPLETIONS, json={**body, "stream": True})),
        ]
        await wait_until(lambda: len(fs.state._token_clock) == 4)
        fs.engine.core.paused = True  # silent: the hang check declares it dead after 0.8 s
        responses = await asyncio.gather(*tasks)
        assert_openai_error(responses[0], 503)
        assert error_events(sse_json(responses[1].text))[-1]["code"] == 503
        assert fs.engine.dead and "hung" in fs.engine.dead
        assert_nothing_kept(fs)

    run(scenario, serve_http=True, step_s=0.01, hang_timeout_s=0.8)


def test_every_other_way_a_sequence_ends_also_stops_its_token_clock():
    """Completion, a stop string, a client leaving mid-stream, the request's deadline, the queue-time
    limit and a failed sibling: after each, nothing of the request is left."""

    async def scenario(fs: FakeServer) -> None:
        base = {"prompt": "hi", "max_tokens": 40, "ignore_eos": True, "n": 2}
        assert (await fs.client.post(COMPLETIONS, json=base)).status_code == 200
        r = await fs.client.post(COMPLETIONS, json={**base, "ignore_eos": False, "stop": ["quick"]})
        assert {c["finish_reason"] for c in r.json()["choices"]} == {"stop"}
        assert_nothing_kept(fs)

        async with fs.client.stream(
            "POST", COMPLETIONS, json={**base, "max_tokens": 100, "stream": True}
        ) as s:
            async for line in s.aiter_lines():
                if line.startswith("data: {"):
                    break  # leave mid-stream: closes the connection
        await wait_until(lambda: fs.engine.num_unfinished == 0)
        assert_nothing_kept(fs)

        r = await fs.client.post(COMPLETIONS, json={**base, "max_tokens": 100, "request_timeout": 0.1})
        assert {c["finish_reason"] for c in r.json()["choices"]} == {"abort"}
        assert_nothing_kept(fs)

        fs.engine.core.paused = True  # nothing starts before the queue-time limit
        assert_openai_error(await fs.client.post(COMPLETIONS, json=base), 503)
        fs.engine.core.paused = False
        assert_nothing_kept(fs)

        fs.engine.core.fail_when = fail_choice("-p0-0", NAN)
        assert_openai_error(await fs.client.post(COMPLETIONS, json={**base, "max_tokens": 100}), 500)
        await wait_until(lambda: not fs.engine.core.running)
        assert_nothing_kept(fs)

    run(
        scenario,
        serve_http=True,
        step_s=0.005,
        max_queue_time=0.2,
        admission=AdmissionControl(max_num_waiting_seqs=16),
    )


def test_output_processing_failing_on_a_sequences_last_output_still_ends_it():
    """The output processor forgets a finished sequence before it builds its last output: if building
    that output raises, the sequence must still end (an error for its client) and its clock stop,
    not leave the client waiting and the entry behind."""

    async def scenario(fs: FakeServer) -> None:
        processor = fs.engine.output_processor
        assert processor is not None
        build = processor._make_output

        def failing_on_the_last(state):
            if state.prompt == "poison" and state.finish_reason is not None:
                raise RuntimeError("detokenizer exploded on the last output")
            return build(state)

        processor._make_output = failing_on_the_last  # type: ignore[method-assign]
        body = {"prompt": "poison", "max_tokens": 8, "ignore_eos": True, "n": 2}
        error = assert_openai_error(await fs.client.post(COMPLETIONS, json=body), 500)
        assert "detokenizer exploded on the last output" in error["message"], error
        chunks = sse_json((await fs.client.post(COMPLETIONS, json={**body, "stream": True})).text)
        assert "detokenizer exploded" in error_events(chunks)[0]["message"]
        assert set(finish_reasons(chunks).values()) == {"error"}
        assert (await fs.client.post(COMPLETIONS, json={**body, "prompt": "fine"})).status_code == 200
        assert_nothing_kept(fs)

    run(scenario, serve_http=True, step_s=0.005, timeout=5)
