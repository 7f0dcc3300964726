"""Property-based fuzzing of the HTTP API against one real server on loopback.

Hypothesis generates request bodies for /v1/completions, /v1/chat/completions, /tokenize and
/detokenize — field-aware ones (each field valid or not: wrong types, huge or negative numbers,
NaN strings, lone surrogates, nested junk, missing fields) and arbitrary JSON — plus raw bytes
under assorted content types and methods. For every input: no 5xx (a 503 would mean the engine
died, which must not happen), every error has OpenAI's error body, streams end with
`data: [DONE]` and never carry a 5xx error event. Afterwards /health is 200, nothing is running
and no request ended with finish_reason "error".

CI runs a fixed set of examples (derandomized). Explore further with
TOKENMILL_FUZZ_RANDOM=1 TOKENMILL_FUZZ_EXAMPLES=2000 pytest tests/reliability/test_fuzz_api.py
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import event as record_event
from hypothesis import strategies as st

from tests.reliability.conftest import SHARED_MODEL
from tests.reliability.server_tools import (
    finished_by_reason,
    openai_error_problem,
    response_error_problem,
    wait_idle,
)
from tokenmill import envs

MODEL = SHARED_MODEL
EXAMPLES = envs.TOKENMILL_FUZZ_EXAMPLES.get() or None


def fuzz_settings(default_examples: int) -> settings:
    return settings(
        max_examples=EXAMPLES or default_examples,
        deadline=None,
        derandomize=not envs.TOKENMILL_FUZZ_RANDOM.get(),
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60.0, connect=10.0)) as client:
        yield client


# --------------------------------------------------------------------------- strategies

WEIRD_STRINGS = st.sampled_from(
    ["", " ", "NaN", "nan", "Infinity", "-inf", "1e309", "null", "true", "0x10", "\x00", "\ud800", "a\udfffb",
     "\u202e\u0000\ufeff", "<|im_start|>", "<|im_end|>", "{{ 7*7 }}", "{% for x in range(10**9) %}{% endfor %}",
     "😀" * 20, "\n" * 50, "a" * 3000]
)  # fmt: skip
TEXT = st.one_of(st.text(max_size=40), WEIRD_STRINGS)
HUGE_INTS = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 10**30, -(2**63) - 1, -1, -(10**30)])
INTS = st.one_of(st.integers(-3, 40), HUGE_INTS)
FLOATS = st.one_of(
    st.floats(-5, 5),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["NaN", "inf", "-Infinity"]),
)
JSON_LEAF = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON_ANY = st.recursive(
    JSON_LEAF,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


def field(good: st.SearchStrategy, bad: st.SearchStrategy | None = None) -> st.SearchStrategy:
    """A field's value: 80% a plausible one, else an edge value (`bad`) or any JSON at all."""
    bad = JSON_ANY if bad is None else st.one_of(bad, JSON_ANY)
    return st.integers(0, 9).flatmap(lambda roll: good if roll < 8 else bad)


def body(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A JSON object: the required fields (each missing one time in ten) and a few optional ones,
    few enough that a fair share of bodies is valid throughout and reaches the engine."""

    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        out = {}
        for key, strategy in required.items():
            if draw(st.integers(0, 9)) > 0:
                out[key] = draw(strategy)
        for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=5, unique=True)):
            out[key] = draw(optional[key])
        return out

    return build()


TOKEN_IDS = st.lists(st.integers(0, 999), min_size=1, max_size=12)
BAD_TOKEN_IDS = st.lists(st.one_of(st.integers(-5, 1100), INTS), max_size=12)
SAMPLING_FIELDS = {
    "model": field(st.just(MODEL), st.just("not-a-model")),
    "max_tokens": field(st.integers(1, 12), st.one_of(st.integers(-1, 0), st.integers(100, 300))),
    "temperature": field(st.floats(0, 2), st.floats(-1, 200)),
    "top_p": field(st.floats(0.01, 1), st.floats(-0.5, 1.5)),
    "top_k": field(st.integers(-1, 60), st.integers(-10, -2)),
    "min_p": field(st.floats(0, 1), st.floats(-0.5, 1.5)),
    "n": field(st.integers(1, 4), st.one_of(st.integers(-1, 0), st.integers(10, 80))),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "stop": field(
        st.one_of(st.text(min_size=1, max_size=5), st.lists(st.text(min_size=1, max_size=5), max_size=4)),
        st.one_of(WEIRD_STRINGS, st.lists(TEXT, max_size=20)),
    ),
    "stop_token_ids": field(TOKEN_IDS, BAD_TOKEN_IDS),
    "seed": field(st.integers(0, 2**32), INTS),
    "presence_penalty": field(st.floats(-2, 2), st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-2, 2), st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(0.1, 2), st.floats(-1, 3)),
    "min_tokens": field(st.integers(0, 4), st.integers(-1, 20)),
    "ignore_eos": field(st.booleans()),
    "include_stop_str_in_output": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "priority": field(st.integers(-5, 5), INTS),
    "cache_salt": field(st.text(min_size=1, max_size=20), WEIRD_STRINGS),
    "prompt_logprobs": field(st.integers(0, 5), st.integers(-1, 25)),
    "request_timeout": field(st.floats(0.01, 2), st.floats(-1, 0)),
    "logit_bias": field(st.just({}), st.dictionaries(st.text(max_size=5), st.floats(-100, 100), max_size=2)),
    "response_format": field(
        st.just({"type": "text"}), st.fixed_dictionaries({"type": st.sampled_from(["json_object", "x"])})
    ),
    "user": field(st.text(max_size=20), WEIRD_STRINGS),
}
MESSAGE = st.fixed_dictionaries(
    {
        "role": field(
            st.sampled_from(["system", "user", "assistant", "developer", "tool"]), st.just("robot")
        ),
        "content": field(
            st.one_of(
                st.text(max_size=40),
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}), max_size=3
                ),
            ),
            st.one_of(
                WEIRD_STRINGS,
                st.lists(
                    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "x"]), "text": JSON_ANY}),
                    max_size=2,
                ),
            ),
        ),
    },
    optional={"name": field(st.text(max_size=10), WEIRD_STRINGS)},
)
MESSAGES = field(st.lists(MESSAGE, min_size=1, max_size=4), st.lists(MESSAGE, max_size=0))
COMPLETION_BODY = body(
    {
        "prompt": field(
            st.one_of(
                st.text(min_size=1, max_size=60),
                TOKEN_IDS,
                st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3),
                st.lists(TOKEN_IDS, min_size=1, max_size=3),
            ),
            st.one_of(WEIRD_STRINGS, BAD_TOKEN_IDS, st.lists(BAD_TOKEN_IDS, max_size=3)),
        )
    },
    {
        **SAMPLING_FIELDS,
        "logprobs": field(st.integers(0, 5), st.integers(-1, 25)),
        "echo": field(st.booleans()),
        "suffix": field(st.just(""), TEXT),
    },
)
CHAT_BODY = body(
    {"messages": MESSAGES},
    {
        **SAMPLING_FIELDS,
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(0, 5), st.integers(-1, 25)),
        "max_completion_tokens": field(st.integers(1, 12), st.integers(-1, 0)),
        "add_generation_prompt": field(st.booleans()),
        "continue_final_message": field(st.booleans()),
        "chat_template_kwargs": field(
            st.just({}),
            st.dictionaries(st.sampled_from(["messages", "x", "add_generation_prompt", "tools"]), JSON_ANY),
        ),
    },
)
TOKENIZE_BODY = st.one_of(
    body(
        {"prompt": field(st.text(max_size=60), WEIRD_STRINGS)},
        {
            "model": SAMPLING_FIELDS["model"],
            "add_special_tokens": field(st.booleans()),
            "return_token_strs": field(st.booleans()),
        },
    ),
    body(
        {"messages": MESSAGES},
        {
            "model": SAMPLING_FIELDS["model"],
            "add_special_tokens": field(st.booleans()),
            "add_generation_prompt": field(st.booleans()),
            "continue_final_message": field(st.booleans()),
            "return_token_strs": field(st.booleans()),
            "chat_template_kwargs": field(
                st.just({}),
                st.dictionaries(st.sampled_from(["messages", "x", "add_generation_prompt"]), JSON_ANY),
            ),
        },
    ),
)
DETOKENIZE_BODY = body(
    {"tokens": field(st.lists(st.integers(0, 999), max_size=12), BAD_TOKEN_IDS)},
    {"model": SAMPLING_FIELDS["model"]},
)
CONTENT_TYPES = st.sampled_from(
    ["application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
     "application/json; charset=latin-1", "", "application/octet-stream"]
)  # fmt: skip
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])


def encode(body: Any) -> bytes:
    # allow_nan: NaN / Infinity literals are not JSON, exactly the kind of input to send.
    return json.dumps(body, allow_nan=True).encode()


# --------------------------------------------------------------------------- checks


def send_and_check(
    http: httpx.Client, method: str, path: str, content: bytes, content_type: str | None
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    with http.stream(method, path, content=content, headers=headers) as response:
        status = response.status_code
        context = f"{method} {path} body={content[:400]!r} -> {status}"
        record_event(f"{path} {status}")
        if status != 200 or "text/event-stream" not in response.headers.get("content-type", ""):
            response.read()
            assert status < 500, f"{context}: {response.text[:500]}"
            if status >= 400:
                problem = response_error_problem(response)
                assert problem is None, f"{context}: {problem}"
            return
        lines = [line for line in response.iter_lines() if line]
    assert lines and lines[-1] == "data: [DONE]", (
        f"{context}: the stream did not end with [DONE]: {lines[-3:]}"
    )
    assert lines.count("data: [DONE]") == 1, f"{context}: more than one [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: "), f"{context}: not an SSE data line: {line[:200]!r}"
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            code = event["error"].get("code")
            assert openai_error_problem(event, code) is None, f"{context}: {event}"
            assert not (isinstance(code, int) and code >= 500), (
                f"{context}: server error in the stream: {event}"
            )


def post_json(http: httpx.Client, path: str, body: Any) -> None:
    send_and_check(http, "POST", path, encode(body), "application/json")


# --------------------------------------------------------------------------- the fuzz tests


@fuzz_settings(100)
@given(body=COMPLETION_BODY)
# Found by this fuzzer: integers past 64 bits used to fail encoding the engine request (500).
@example(body={"prompt": "0", "priority": 2**64})
@example(body={"prompt": "0", "top_k": 2**70})
def test_fuzz_completions(http, body):
    post_json(http, "/v1/completions", body)


@fuzz_settings(100)
@given(body=CHAT_BODY)
def test_fuzz_chat_completions(http, body):
    post_json(http, "/v1/chat/completions", body)


@fuzz_settings(60)
@given(body=TOKENIZE_BODY)
# Found by this fuzzer: a lone surrogate escape ("\\ud800") used to reach the tokenizer (500).
@example(body={"prompt": "\ud800"})
@example(body={"messages": [{"role": "user", "content": "a\udfffb"}]})
def test_fuzz_tokenize(http, body):
    post_json(http, "/tokenize", body)


@fuzz_settings(40)
@given(body=DETOKENIZE_BODY)
def test_fuzz_detokenize(http, body):
    post_json(http, "/detokenize", body)


@fuzz_settings(60)
@given(path=PATHS, body=JSON_ANY)
def test_fuzz_any_json(http, path, body):
    post_json(http, path, body)


@fuzz_settings(80)
@given(
    path=st.one_of(
        PATHS, st.sampled_from(["/v1/models", "/health", "/metrics", "/version", "/v1/../tokenize", "/%00"])
    ),
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH"]),
    content=st.one_of(st.binary(max_size=300), st.builds(encode, JSON_ANY).map(lambda b: b[: len(b) // 2])),
    content_type=CONTENT_TYPES,
)
def test_fuzz_raw_bytes_and_content_types(http, path, method, content, content_type):
    send_and_check(http, method, path, content, content_type)


def test_oversized_body_and_headers(http, server):
    big = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
    response = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response_error_problem(response) is None, response.text[:300]
    # A header far beyond any sane size: refused (by the HTTP parser) or ignored, never a crash.
    try:
        response = http.post("/tokenize", json={"prompt": "hi"}, headers={"x-junk": "a" * 200_000})
        assert response.status_code < 500, response.text[:300]
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError):
        pass  # refused by closing the connection (after a 400 the client may not get to read): fine
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_server_is_healthy_after_the_fuzzing(http, server):
    """Runs last in this module: after every input above, the server still serves normally."""
    assert http.get("/health").status_code == 200
    wait_idle(server.base_url)
    assert finished_by_reason(server.base_url).get("error", 0) == 0, "a fuzzed request ended with 'error'"
    response = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5, "ignore_eos": True}
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 5
