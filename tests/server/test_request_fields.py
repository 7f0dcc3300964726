"""Every request field is honoured or refused by name: the fields the server handles itself
(defaults, priority, truncation, special tokens, usage, token-id logprobs, prompt logprobs in chat,
request ids, templates), the constraint fields' mapping and checks, and unknown fields (logged once).
Against the scripted fake engine, which records what reached it."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from tests.server.fake_engine import MODEL, REPLY, FakeEngine
from tests.server.test_api_inprocess import run, sse_events
from tokenmill.server.state import ServerState

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **fields}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat(best_of=3), "best_of"),
        (CHAT, chat(use_beam_search=True), "use_beam_search"),
        (CHAT, chat(length_penalty=0.5), "length_penalty"),
        (CHAT, chat(functions=[{"name": "f"}]), "functions"),
        (CHAT, chat(function_call="auto"), "function_call"),
        (CHAT, chat(audio={"voice": "x"}), "audio"),
        (CHAT, chat(modalities=["text", "audio"]), "modalities"),
        (CHAT, chat(prediction={"type": "content", "content": "x"}), "prediction"),
        (CHAT, chat(logits_processors=["x"]), "logits_processors"),
        (CHAT, chat(kv_transfer_params={"transfer_id": "t1"}), "kv_transfer_params"),  # no --kv-role
        (CHAT, chat(priority=3), "priority"),
        (CHAT, chat(chat_template="{{ messages }}"), "chat_template"),
        (CHAT, chat(documents=[{"title": "t", "text": "x"}]), "documents"),
        (CHAT, chat(reasoning_effort="low"), "reasoning_effort"),
        (CHAT, chat(logit_bias={"abc": 1}), "logit_bias"),
        (CHAT, chat(logit_bias={"3": 101}), "logit_bias"),
        (CHAT, chat(guided_json={"type": "nonsense"}), "guided_json"),
        (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
        (
            CHAT,
            chat(response_format={"type": "json_schema", "json_schema": {"schema": {"minLength": "3"}}}),
            "response_format.json_schema.schema",
        ),
        (CHAT, chat(guided_regex="a+", guided_choice=["a"]), "guided_choice"),
        (CHAT, chat(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs"),
        (CHAT, chat(structured_outputs={"regex": "a", "backend": "outlines"}), "structured_outputs.backend"),
        (CHAT, chat(structured_outputs={"json": {}, "whitespace_pattern": " "}), "structured_outputs.whitespace_pattern"),
        (CHAT, chat(guided_whitespace_pattern=" "), "guided_whitespace_pattern"),
        (CHAT, chat(guided_choice=[]), "guided_choice"),
        (CHAT, chat(tool_choice="required"), "tool_choice"),
        (CHAT, chat(return_token_ids=True), "return_token_ids"),
        (CHAT, chat(mm_processor_kwargs={"a": 1}), "mm_processor_kwargs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "prompt_embeds": "abc"}, "prompt_embeds"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused_by_name(path, body, param):
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        r = await client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param, error
        assert engine.core.requests == []  # refused before the engine saw it

    run(scenario)


def test_kv_transfer_params_reach_a_disaggregated_engine_and_unknown_keys_are_refused():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        r = await client.post(CHAT, json=chat(kv_transfer_params={"transfer_id": "t1"}))
        assert r.status_code == 200, r.text
        assert engine.core.requests[-1].sampling_params.kv_transfer_id == "t1"
        for bad in ({"transfer_id": "t", "remote_block_ids": [1]}, {"transfer_id": ""}, {}):
            r = await client.post(CHAT, json=chat(kv_transfer_params=bad))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"].startswith("kv_transfer_params"), r.json()
        assert len(engine.core.requests) == 1

    run(scenario, kv_role="consumer")


def test_unknown_fields_are_accepted_and_logged_once_per_name(caplog):
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        with caplog.at_level(logging.WARNING, logger="tokenmill.server"):
            for _ in range(3):
                r = await client.post(CHAT, json=chat(frobnicate_level=3))
                assert r.status_code == 200, r.text
        lines = [rec.getMessage() for rec in caplog.records if "frobnicate_level" in rec.getMessage()]
        assert len(lines) == 1, lines

    run(scenario)


def test_accepted_openai_fields_change_nothing():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        plain = (await client.post(CHAT, json=chat())).json()
        extras = (
            await client.post(
                CHAT, json=chat(user="u1", store=False, metadata={"k": "v"}, service_tier="auto", best_of=1)
            )
        ).json()
        assert plain["choices"][0]["message"] == extras["choices"][0]["message"]

    run(scenario)


def test_generation_defaults_fill_only_unset_fields():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        state.default_sampling = {"temperature": 0.25, "top_p": 0.5, "top_k": 7, "max_tokens": 3}
        await client.post(CHAT, json={"model": MODEL, "messages": MESSAGES})
        await client.post(CHAT, json={"model": MODEL, "messages": MESSAGES, "temperature": 0.9, "max_tokens": 4})
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc"})
        first, second, third = (req.sampling_params for req in engine.core.requests)
        assert (first.temperature, first.top_p, first.top_k, first.max_tokens) == (0.25, 0.5, 7, 3)
        assert (second.temperature, second.top_p, second.max_tokens) == (0.9, 0.5, 4)
        assert (third.temperature, third.max_tokens) == (0.25, 3)

    run(scenario)


def test_priority_is_honoured_under_the_priority_policy():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        r = await client.post(CHAT, json=chat(priority=-2))
        assert r.status_code == 200, r.text
        assert engine.core.requests[-1].priority == -2

    run(scenario, scheduling_policy="priority")


def test_truncate_prompt_tokens_and_add_special_tokens():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        body = {"model": MODEL, "prompt": "abcdefghij", "max_tokens": 2}
        r = await client.post("/v1/completions", json={**body, "truncate_prompt_tokens": 4})
        assert r.json()["usage"]["prompt_tokens"] == 4
        assert engine.core.requests[-1].prompt_token_ids == state.engine.tokenizer.encode("ghij")
        r = await client.post(CHAT, json=chat(truncate_prompt_tokens=3))
        assert len(engine.core.requests[-1].prompt_token_ids) == 3
        plain = await client.post(CHAT, json=chat())
        special = await client.post(CHAT, json=chat(add_special_tokens=True))
        tokens_plain = plain.json()["usage"]["prompt_tokens"]
        # The tiny tokenizer adds nothing of its own, so the prompt is the same either way; the field
        # reaches the tokenizer (a tokenizer with a BOS would add one).
        assert special.json()["usage"]["prompt_tokens"] >= tokens_plain

    run(scenario)


def test_continuous_usage_stats_and_token_id_logprobs():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        body = chat(
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            logprobs=True,
            top_logprobs=2,
            return_tokens_as_token_ids=True,
        )
        r = await client.post(CHAT, json=body)
        events = [json.loads(e) for e in sse_events(r.text)[:-1]]
        token_chunks = [e for e in events if e["choices"] and e["choices"][0].get("logprobs")]
        assert token_chunks
        for e in token_chunks:
            assert e["usage"] is not None and e["usage"]["completion_tokens"] >= 1
            for entry in e["choices"][0]["logprobs"]["content"]:
                assert entry["token"].startswith("token_id:")
                assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])
        completions = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "ab", "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": True},
        )
        assert all(t.startswith("token_id:") for t in completions.json()["choices"][0]["logprobs"]["tokens"])

    run(scenario)


def test_chat_returns_prompt_logprobs_and_honours_request_id():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        r = await client.post(CHAT, json=chat(prompt_logprobs=1, request_id="my-request-7"))
        body = r.json()
        assert body["id"] == "my-request-7"
        positions = body["prompt_logprobs"]
        assert positions[0] is None
        assert len(positions) == body["usage"]["prompt_tokens"]
        assert all(isinstance(p, dict) and p for p in positions[1:])

    run(scenario)


def test_request_chat_template_and_documents_when_trusted():
    template = (
        "{% for d in documents %}[{{ d['title'] }}]{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )

    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        r = await client.post(CHAT, json=chat(chat_template=template, documents=[{"title": "doc1"}]))
        assert r.status_code == 200, r.text
        prompt = state.engine.tokenizer.decode(engine.core.requests[-1].prompt_token_ids)
        assert prompt == "[doc1]hi"

    run(scenario, trust_request_chat_template=True)


def test_constraint_fields_reach_the_engine_as_one_structured_output():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        cases = [
            ({"response_format": {"type": "json_object"}}, "json_object", True),
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}, "json", schema),
            ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
            ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
            ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", 'root ::= "x"'),
            ({"guided_json": json.dumps(schema)}, "json", schema),
            ({"guided_regex": "a|b"}, "regex", "a|b"),
            ({"guided_choice": ["x"]}, "choice", ["x"]),
            ({"guided_grammar": 'root ::= "y"', "guided_decoding_backend": "xgrammar"}, "grammar", 'root ::= "y"'),
        ]
        for fields, kind, spec in cases:
            for path, body in ((CHAT, chat(**fields)), ("/v1/completions", {"model": MODEL, "prompt": "x", **fields})):
                r = await client.post(path, json=body)
                assert r.status_code == 200, (fields, r.text)
                so = engine.core.requests[-1].sampling_params.structured_outputs
                assert so is not None and so.kind == kind and so.spec == spec, (fields, so)
        r = await client.post(CHAT, json=chat(response_format={"type": "text"}))
        assert engine.core.requests[-1].sampling_params.structured_outputs is None

    run(scenario)


def test_engine_compile_errors_are_400_naming_the_field():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        engine.core.fail_when = lambda req, k: (
            "invalid structured output: the regex does not compile: unbalanced ("
            if req.sampling_params.structured_outputs is not None
            else None
        )
        for stream in (False, True):
            r = await client.post(CHAT, json=chat(guided_regex="(a", stream=stream))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "guided_regex"
            assert "unbalanced" in r.json()["error"]["message"]
            r = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "(a"}, "stream": stream, "n": 2},
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "structured_outputs"
        ok = await client.post(CHAT, json=chat())
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == REPLY[:5]

    run(scenario)


def test_chat_echo_returns_the_continued_message_whole():
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        messages = [*MESSAGES, {"role": "assistant", "content": "Once"}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 4, "echo": True,
                "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
        r = await client.post(CHAT, json=body)
        assert r.json()["choices"][0]["message"]["content"] == "Once" + REPLY[:4]
        r = await client.post(CHAT, json={**body, "stream": True})
        text = "".join(
            json.loads(e)["choices"][0]["delta"].get("content") or "" for e in sse_events(r.text)[:-1]
        )
        assert text == "Once" + REPLY[:4]
        # The last message is the user's: nothing to echo.
        r = await client.post(CHAT, json=chat(echo=True, max_tokens=4))
        assert r.json()["choices"][0]["message"]["content"] == REPLY[:4]

    run(scenario)


def test_a_schema_seen_before_is_not_checked_again_and_a_bad_one_is_refused_each_time(monkeypatch):
    """The metaschema walk costs milliseconds on the event loop per request: once per schema."""
    import jsonschema.validators

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "description": "cache-test-1"}
    validator = jsonschema.validators.validator_for(schema)
    walks: list[object] = []
    real = validator.check_schema
    monkeypatch.setattr(validator, "check_schema", lambda s, *a, **k: (walks.append(s), real(s, *a, **k))[1])

    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        same = [
            chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}),
            chat(structured_outputs={"json": dict(reversed(schema.items()))}, stream=True),
            {"model": MODEL, "prompt": "x", "guided_json": json.dumps(schema), "stream": True},
        ]
        for body in same:
            r = await client.post(CHAT if "messages" in body else "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert engine.core.requests[-1].sampling_params.structured_outputs.json == json.loads(json.dumps(schema))
        assert len(walks) == 1
        bad = {**schema, "minProperties": "one"}
        for _ in range(2):
            r = await client.post(CHAT, json=chat(structured_outputs={"json": bad}))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "structured_outputs.json"
            assert "minProperties" in r.json()["error"]["message"]
        assert len(walks) == 3

    run(scenario)


def test_a_constrained_stream_sends_its_first_token_while_the_engine_makes_no_more():
    """A constrained stream waits for its first output before the response starts (a constraint
    that does not compile is a 400): that first output is its first token, sent at once, not held
    until more tokens come. The engine is paused right after the first token to prove it."""
    from tokenmill.server.protocol import CompletionRequest
    from tokenmill.server.serving_completion import create_completion

    schema = {"type": "object", "properties": {"x": {"type": "string"}}}

    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        def pause_after_first_token(req, generated: int) -> None:
            if generated == 0:  # this step emits the first token; the core says nothing after it
                engine.core.paused = True

        engine.core.fail_when = pause_after_first_token
        for fields in ({"structured_outputs": {"json": schema}}, {}):  # constrained, then plain
            engine.core.paused = False
            body = CompletionRequest.model_validate(
                {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True, **fields}
            )
            events = await create_completion(state, body)
            first = json.loads((await asyncio.wait_for(events.__anext__(), 5)).removeprefix("data: "))
            (seq,) = engine.core.running.values()
            assert engine.core.paused and seq.num_generated == 1  # nothing after the first token
            assert first["choices"][0]["text"] == engine.tokenizer.decode(engine.core.reply_ids[:1])
            engine.core.paused = False
            rest = [e async for e in events]
            assert rest[-1] == "data: [DONE]\n\n"

    run(scenario)
