"""Tool calling and reasoning through the HTTP API with the `openai` SDK, streaming and not, against
the scripted fake engine replaying recorded-style model outputs (one byte per token, so streams
split the calls at every byte). Grammar enforcement itself is tested on a real model
(tests/server/test_server.py, tests/engine/test_structured_output.py)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tests.server.fake_engine import MODEL, FakeEngine, fake_server_state
from tokenmill.server.api_server import create_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]

# What models of each family write when they call tools (recorded-style outputs).
AUTO_OUTPUTS = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
    '{"name": "get_time", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
    '{"name": "get_time", "arguments": {}}]',
    "pythonic": '[get_weather(city="Paris", days=2), get_time()]',
}
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]


def run_with(reply: str, scenario, **state_kwargs) -> None:
    async def main() -> None:
        engine = FakeEngine(max_model_len=1024, num_kv_blocks=1024)
        await engine.start()
        engine.core.reply_ids = engine.tokenizer.encode(reply, add_special_tokens=False)
        state = fake_server_state(engine, **state_kwargs)
        transport = httpx.ASGITransport(app=create_app(state))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as http:
                client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
                await asyncio.wait_for(scenario(client, engine), 20)
        finally:
            await engine.shutdown()

    asyncio.run(main())


async def streamed(client: openai.AsyncOpenAI, **kwargs) -> tuple[str, str, list[tuple[str, str, str]], str]:
    """(content, reasoning, [(id, name, arguments)], finish_reason) accumulated from a stream."""
    content, reasoning, finish = "", "", None
    calls: dict[int, list[str]] = {}
    stream = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kwargs)
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", "", ""])
            if call.id:
                assert not entry[0], "a call's id is sent once"
                entry[0] = call.id
            if call.function and call.function.name:
                assert not entry[1], "a call's name is sent once"
                entry[1] = call.function.name
            if call.function and call.function.arguments:
                entry[2] += call.function.arguments
        finish = choice.finish_reason or finish
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("parser", sorted(AUTO_OUTPUTS))
def test_auto_tool_choice_with_each_parser(parser):
    async def scenario(client: openai.AsyncOpenAI, engine: FakeEngine) -> None:
        whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls"
        got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
        assert got == EXPECTED_CALLS
        assert len({c.id for c in choice.message.tool_calls}) == 2
        content, _, calls, finish = await streamed(client, tools=TOOLS, tool_choice="auto")
        assert finish == "tool_calls"
        assert [(name, json.loads(args)) for _, name, args in calls] == EXPECTED_CALLS
        assert all(call_id for call_id, _, _ in calls)
        assert content.strip() == (choice.message.content or "").strip()

    run_with(AUTO_OUTPUTS[parser], scenario, enable_auto_tool_choice=True, tool_call_parser=parser)


def test_auto_without_a_call_is_plain_content():
    async def scenario(client: openai.AsyncOpenAI, engine: FakeEngine) -> None:
        whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
        assert whole.choices[0].message.content == "It is sunny."
        assert not whole.choices[0].message.tool_calls
        assert whole.choices[0].finish_reason == "stop"
        content, _, calls, finish = await streamed(client, tools=TOOLS)
        assert (content, calls, finish) == ("It is sunny.", [], "stop")

    run_with("It is sunny.", scenario, enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_required_and_named_tool_choice_are_forced_by_a_schema():
    required_reply = '[{"name":"get_weather","parameters":{"city":"Paris","days":2}},{"name":"get_time","parameters":{}}]'

    async def required(client: openai.AsyncOpenAI, engine: FakeEngine) -> None:
        whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required")
        got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
        assert got == EXPECTED_CALLS and whole.choices[0].finish_reason == "tool_calls"
        so = engine.core.requests[-1].sampling_params.structured_outputs
        assert so is not None and so.kind == "json" and so.spec["type"] == "array"
        _, _, calls, finish = await streamed(client, tools=TOOLS, tool_choice="required")
        assert [(n, json.loads(a)) for _, n, a in calls] == EXPECTED_CALLS and finish == "tool_calls"
        # parallel_tool_calls=false: at most one call.
        await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
        )
        assert engine.core.requests[-1].sampling_params.structured_outputs.spec["maxItems"] == 1

    run_with(required_reply, required)

    async def named(client: openai.AsyncOpenAI, engine: FakeEngine) -> None:
        choice = {"type": "function", "function": {"name": "get_weather"}}
        whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice)
        (call,) = whole.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome"}
        so = engine.core.requests[-1].sampling_params.structured_outputs
        assert so.spec["properties"]["city"] == {"type": "string"}
        _, _, calls, _ = await streamed(client, tools=TOOLS, tool_choice=choice)
        assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Rome"})]

    run_with('{"city":"Rome"}', named)


def test_tool_request_errors():
    async def scenario(client: openai.AsyncOpenAI, engine: FakeEngine) -> None:
        bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}
        cases = [
            ({"tools": TOOLS}, "tool_choice"),  # auto without a parser
            ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
            ({"tools": [bad_schema], "tool_choice": "required"}, "tools"),
            ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ]
        for fields, param in cases:
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=MODEL, messages=MESSAGES, **fields)
            assert (info.value.body or {}).get("param", "").startswith(param), (fields, info.value.body)
        assert engine.core.requests == []

    run_with("x", scenario)


def test_tool_messages_and_tools_reach_the_template():
    template = (
        "{{ tools | map(attribute='function.name') | join(',') }}|"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments.city }}){% endif %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]

    async def scenario(client: openai.AsyncOpenAI, engine: FakeEngine) -> None:
        await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", extra_body={"chat_template": template}
        )
        prompt = engine.tokenizer.decode(engine.core.requests[-1].prompt_token_ids)
        assert prompt == "get_weather,get_time|user:weather in Paris?;assistant:get_weather(Paris);tool:sunny#call_1;"

    run_with("ok", scenario, trust_request_chat_template=True)


def test_reasoning_parser_splits_reasoning_whole_and_streamed():
    async def scenario(client: openai.AsyncOpenAI, engine: FakeEngine) -> None:
        whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES)
        message = whole.choices[0].message
        assert message.reasoning_content == "Paris is in France."
        assert message.content == "Sunny."
        content, reasoning, _, _ = await streamed(client)
        assert (reasoning, content) == ("Paris is in France.", "Sunny.")
        hidden = await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"include_reasoning": False}
        )
        assert getattr(hidden.choices[0].message, "reasoning_content", None) is None
        assert hidden.choices[0].message.content == "Sunny."
        # A constraint applies to the answer: it starts after the end-of-thinking tokens.
        await client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format={"type": "json_object"}
        )
        so = engine.core.requests[-1].sampling_params.structured_outputs
        assert so.start_after_token_ids == engine.tokenizer.encode("</think>", add_special_tokens=False)

    run_with("<think>Paris is in France.</think>Sunny.", scenario, reasoning_parser="qwen3")


def test_reasoning_then_forced_tool_call():
    async def scenario(client: openai.AsyncOpenAI, engine: FakeEngine) -> None:
        whole = await client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required")
        message = whole.choices[0].message
        assert message.reasoning_content == "I need the weather."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("get_weather", {"city": "Oslo"})
        ]
        _, reasoning, calls, finish = await streamed(client, tools=TOOLS, tool_choice="required")
        assert reasoning == "I need the weather." and finish == "tool_calls"
        assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Oslo"})]

    reply = '<think>I need the weather.</think>[{"name":"get_weather","parameters":{"city":"Oslo"}}]'
    run_with(reply, scenario, reasoning_parser="deepseek_r1")
