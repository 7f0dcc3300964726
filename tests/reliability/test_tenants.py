"""Tenants' prefix caches are separate: `cache_salt` (an extra body field) keys the cached blocks.

The same long prompt under a different salt (or none) must find nothing cached
(`usage.prompt_tokens_details.cached_tokens == 0`); under the same salt it must find its blocks.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.reliability.conftest import SHARED_MODEL

BLOCK_SIZE = 16  # the server's default
WORDS = ("the", "cache", "block", "page", "attention", "request", "batch", "stream", "server", "engine")


@pytest.fixture(scope="module")
def http(shared_server):
    with httpx.Client(base_url=shared_server.base_url, timeout=60) as client:
        yield client


def long_prompt(http: httpx.Client) -> str:
    """A prompt of 64..110 tokens (4+ full KV blocks, inside the 128-token context) that no other
    test sent, so any cache hit comes from this test's own requests."""
    text = f"tenant probe {uuid.uuid4().hex}: " + " ".join(WORDS[i % len(WORDS)] for i in range(55))
    num_tokens = http.post("/tokenize", json={"prompt": text}).json()["count"]
    assert 64 <= num_tokens <= 110, f"the probe prompt is {num_tokens} tokens; adjust its length"
    return text


def complete(http: httpx.Client, prompt: str, salt: str | None) -> dict:
    body = {"model": SHARED_MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_different_salts_share_no_cached_blocks_and_the_same_salt_does(http):
    prompt = long_prompt(http)
    first = complete(http, prompt, "tenant-a")
    assert cached(first) == 0
    full_blocks = (first["prompt_tokens"] - 1) // BLOCK_SIZE
    assert full_blocks >= 3

    for other in ("tenant-b", "tenant-a ", "TENANT-A", None):  # near-misses and no salt are other tenants
        assert cached(complete(http, prompt, other)) == 0, f"salt {other!r} saw tenant-a's cached blocks"

    again = complete(http, prompt, "tenant-a")
    assert cached(again) >= (full_blocks - 1) * BLOCK_SIZE, again
    assert cached(again) < again["prompt_tokens"]
    # Unsalted requests form one tenant of their own: the unsalted call above cached the prompt.
    assert cached(complete(http, prompt, None)) > 0
    # And the salt above was not consumed by any other tenant in between.
    assert cached(complete(http, prompt, "tenant-b")) > 0


def test_salts_separate_streamed_chat_too(http):
    content = long_prompt(http)

    def chat(salt: str) -> int:
        body = {
            "model": SHARED_MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "cache_salt": salt,
        }
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            events = [
                json.loads(line[6:]) for line in response.iter_lines() if line and line != "data: [DONE]"
            ]
        usage = [e["usage"] for e in events if e.get("usage")]
        assert len(usage) == 1, events
        return cached(usage[0])

    assert chat("x") == 0
    assert chat("y") == 0
    assert chat("x") > 0
    assert chat("y") > 0


def test_a_salt_must_be_a_non_empty_string(http):
    for bad in ("", 5, ["a"], {"a": 1}):
        response = http.post(
            "/v1/completions", json={"model": SHARED_MODEL, "prompt": "hi", "cache_salt": bad}
        )
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"] == "cache_salt"
