"""OpenAI request/response models: shapes, round trips, errors that name the field, sampling params."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tokenmill.errors import InvalidRequestError
from tokenmill.server.protocol import (
    MAX_N,
    SSE_DONE,
    ChatCompletionLogprobs,
    ChatCompletionLogprobsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    DetokenizeRequest,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UsageInfo,
    parse_request,
    parse_tokenize_request,
    sse_event,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_request_round_trip_keeps_every_field() -> None:
    body = {
        **CHAT,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ],
        "max_completion_tokens": 7,
        "temperature": 0.5,
        "top_p": 0.9,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "stop": ["\n", "END"],
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 2,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "min_tokens": 1,
        "ignore_eos": True,
        "stop_token_ids": [7],
        "priority": -1,
        "cache_salt": "tenant-a",
        "request_timeout": 2.5,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    req = parse_request(ChatCompletionRequest, body)
    again = ChatCompletionRequest.model_validate_json(req.model_dump_json())
    assert again == req
    assert req.include_usage_in_stream
    assert req.messages_for_template() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]


def test_unknown_fields_are_accepted_and_dropped() -> None:
    # Logged once per name (tests/server/test_request_fields.py); an empty tools list is no tools.
    req = parse_request(ChatCompletionRequest, {**CHAT, "tools": [], "some_vendor_extra": {"x": 1}})
    assert not hasattr(req, "some_vendor_extra") and not req.model_extra


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt: object, expected: list) -> None:
    req = parse_request(CompletionRequest, {"model": "m", "prompt": prompt})
    assert req.prompts() == expected


@pytest.mark.parametrize(
    ("cls", "body", "param"),
    [
        (CompletionRequest, {"prompt": 5}, "prompt"),
        (CompletionRequest, {"prompt": []}, "prompt"),
        (CompletionRequest, {"prompt": [[1], []]}, "prompt"),
        (CompletionRequest, {"prompt": [1, -2]}, "prompt"),
        (CompletionRequest, {}, "prompt"),
        (CompletionRequest, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        (CompletionRequest, {"prompt": "x", "n": MAX_N + 1}, "n"),
        (CompletionRequest, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (CompletionRequest, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (CompletionRequest, {"prompt": "x", "stop": [""]}, "stop"),
        (CompletionRequest, {"prompt": "x", "stop": ["s"] * 17}, "stop"),
        (CompletionRequest, {"prompt": "x", "logit_bias": {"5": 1000.0}}, "logit_bias"),
        (CompletionRequest, {"prompt": "x", "response_format": {"type": "xml"}}, "response_format.type"),
        (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, None),
        (CompletionRequest, {"prompt": "x", "request_timeout": 0}, "request_timeout"),
        (CompletionRequest, {"prompt": "x", "suffix": "tail"}, "suffix"),
        (ChatCompletionRequest, {"messages": []}, "messages"),
        (ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (ChatCompletionRequest, {**CHAT, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        (ChatCompletionRequest, {**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
        (ChatCompletionRequest, {**CHAT, "seed": 2**70}, "seed"),
    ],
)
def test_validation_errors_name_the_field(cls: type, body: dict, param: str | None) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(cls, body)
    assert info.value.param == param
    assert info.value.status_code == 400
    if param is not None:
        assert param in info.value.message


def test_image_content_part_is_refused_naming_the_message() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    with pytest.raises(InvalidRequestError) as info:
        parse_request(ChatCompletionRequest, body)
    assert info.value.param.startswith("messages.0.content")
    assert "image_url" in info.value.message


def test_non_finite_floats_are_refused() -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(CompletionRequest, b'{"prompt": "x", "temperature": NaN}')
    assert info.value.param == "temperature"


def test_malformed_json_and_non_object_bodies() -> None:
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        parse_request(CompletionRequest, b'{"prompt": ')
    with pytest.raises(InvalidRequestError, match="JSON object"):
        parse_request(CompletionRequest, b"[1, 2]")


def test_null_fields_mean_defaults() -> None:
    body = {"prompt": "x", "n": None, "stream": None, "logprobs": None, "temperature": None, "stop": None}
    sp = parse_request(CompletionRequest, body).to_sampling_params(default_max_tokens=8)
    assert (sp.n, sp.temperature, sp.logprobs, sp.stop, sp.max_tokens) == (1, 1.0, None, [], 8)
    chat = parse_request(ChatCompletionRequest, {**CHAT, "logprobs": None, "n": None})
    assert chat.logprobs is False and chat.n == 1
    with pytest.raises(InvalidRequestError) as info:
        parse_request(CompletionRequest, {"prompt": None})
    assert info.value.param == "prompt"


def test_accepted_no_op_values() -> None:
    req = parse_request(
        CompletionRequest, {"prompt": "x", "logit_bias": {}, "response_format": {"type": "text"}, "user": "u"}
    )
    assert req.logit_bias == {}


def test_chat_sampling_params() -> None:
    req = parse_request(
        ChatCompletionRequest,
        {
            **CHAT,
            "max_tokens": 9,
            "max_completion_tokens": 4,
            "logprobs": True,
            "top_logprobs": 3,
            "stop": "x",
        },
    )
    sp = req.to_sampling_params(default_max_tokens=100)
    assert sp.max_tokens == 4  # max_completion_tokens wins over the deprecated max_tokens
    assert sp.logprobs == 3
    assert sp.stop == ["x"]
    assert sp.top_k == 0 and sp.temperature == 1.0 and sp.top_p == 1.0
    assert parse_request(ChatCompletionRequest, CHAT).to_sampling_params(100).max_tokens == 100
    assert (
        parse_request(ChatCompletionRequest, {**CHAT, "logprobs": True}).to_sampling_params(1).logprobs == 0
    )
    assert parse_request(ChatCompletionRequest, CHAT).to_sampling_params(1).logprobs is None


def test_completion_sampling_params() -> None:
    body = {
        "prompt": "x",
        "max_tokens": 5,
        "logprobs": 2,
        "echo": True,
        "temperature": 0,
        "top_k": -1,
        "stop_token_ids": [3],
        "ignore_eos": True,
        "min_tokens": 2,
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
    }
    sp = parse_request(CompletionRequest, body).to_sampling_params(default_max_tokens=100)
    assert (sp.max_tokens, sp.logprobs, sp.prompt_logprobs) == (5, 2, 2)  # echo: prompt logprobs too
    assert sp.is_greedy and sp.top_k == 0
    assert sp.stop_token_ids == [3] and sp.ignore_eos and sp.min_tokens == 2
    assert not sp.skip_special_tokens and sp.include_stop_str_in_output


@pytest.mark.parametrize(
    ("cls", "body", "param"),
    [
        (CompletionRequest, {"prompt": "x", "temperature": 500}, "temperature"),
        (CompletionRequest, {"prompt": "x", "top_p": 0}, "top_p"),
        (CompletionRequest, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        (ChatCompletionRequest, {**CHAT, "top_logprobs": 2}, "top_logprobs"),
        (ChatCompletionRequest, {**CHAT, "presence_penalty": 3}, "presence_penalty"),
        (ChatCompletionRequest, {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_bad_sampling_values_raise_with_param(cls: type, body: dict, param: str) -> None:
    req = parse_request(cls, body)
    with pytest.raises(InvalidRequestError) as info:
        req.to_sampling_params(default_max_tokens=16)
    assert info.value.param == param


def test_completion_response_parses_with_the_openai_client_types() -> None:
    usage = UsageInfo(
        prompt_tokens=3,
        completion_tokens=2,
        total_tokens=5,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=2),
    )
    logprobs = CompletionLogprobs(
        text_offset=[0, 2],
        token_logprobs=[-0.1, -0.2],
        tokens=["hi", "!"],
        top_logprobs=[{"hi": -0.1}, {"!": -0.2}],
    )
    resp = CompletionResponse(
        model="m",
        choices=[CompletionResponseChoice(index=0, text="hi!", logprobs=logprobs, finish_reason="length")],
        usage=usage,
    )
    parsed = Completion.model_validate_json(resp.model_dump_json())
    assert parsed.choices[0].text == "hi!"
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2
    assert CompletionResponse.model_validate_json(resp.model_dump_json()) == resp
    chunk = CompletionStreamResponse(model="m", choices=[CompletionResponseChoice(index=0, text="h")])
    # The openai client builds stream chunks without validation (finish_reason null mid-stream).
    data = json.loads(sse_event(chunk).removeprefix("data: "))
    assert data["object"] == "text_completion" and data["choices"][0] == {
        "index": 0,
        "text": "h",
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
    }


def test_chat_response_and_chunk_parse_with_the_openai_client_types() -> None:
    lp = ChatCompletionLogprobs(
        content=[ChatCompletionLogprobsContent(token="a", logprob=-0.5, bytes=[97], top_logprobs=[])]
    )
    resp = ChatCompletionResponse(
        model="m",
        choices=[
            ChatCompletionResponseChoice(
                index=0, message=ChatResponseMessage(content="a"), logprobs=lp, finish_reason="stop"
            )
        ],
        usage=UsageInfo(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )
    parsed = ChatCompletion.model_validate_json(resp.model_dump_json())
    assert parsed.choices[0].message.content == "a"
    assert parsed.choices[0].logprobs.content[0].logprob == -0.5
    assert resp.id.startswith("chatcmpl-")

    chunk = ChatCompletionStreamResponse(
        model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(role="assistant", content=""))],
    )
    event = sse_event(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n")
    data = json.loads(event.removeprefix("data: "))
    assert data["object"] == "chat.completion.chunk"
    assert ChatCompletionChunk.model_validate(data).choices[0].delta.role == "assistant"
    assert SSE_DONE == "data: [DONE]\n\n"


def test_error_body_has_openai_shape() -> None:
    body = ErrorResponse.from_exception(InvalidRequestError("n must be >= 1", param="n")).model_dump()
    assert body == {
        "error": {"message": "n must be >= 1", "type": "invalid_request_error", "param": "n", "code": 400}
    }


def test_models_and_tokenize_shapes() -> None:
    models = ModelList(data=[ModelCard(id="smol", root="/models/smol", max_model_len=2048)]).model_dump()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "smol" and models["data"][0]["root"] == "/models/smol"

    tok = parse_tokenize_request(b'{"model": "smol", "prompt": "hi"}')
    assert isinstance(tok, TokenizeCompletionRequest) and tok.add_special_tokens
    chat_tok = parse_tokenize_request({"messages": [{"role": "user", "content": "hi"}]})
    assert isinstance(chat_tok, TokenizeChatRequest) and not chat_tok.add_special_tokens
    with pytest.raises(InvalidRequestError):
        parse_tokenize_request(b"not json")
    with pytest.raises(InvalidRequestError) as info:
        parse_request(DetokenizeRequest, {"tokens": [1, -1]})
    assert info.value.param == "tokens"


def test_continue_final_message_rules() -> None:
    with pytest.raises(InvalidRequestError):
        parse_request(ChatCompletionRequest, {**CHAT, "continue_final_message": True})  # both true
    body = {
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    assert parse_request(ChatCompletionRequest, body).continue_final_message
