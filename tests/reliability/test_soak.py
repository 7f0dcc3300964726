"""A bounded soak against the real server: mixed traffic and client-caused faults, then an audit.

The load and every check live in tests/reliability/soak.py (also a script for longer runs); this is
its CI-sized run (~20 s of load) on a tiny random checkpoint with small queue and KV limits, so
bursts meet admission control and the scheduler preempts.
"""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from tests.reliability.server_tools import process_tree, start_tiny_server, survivors
from tests.reliability.soak import DEFAULT_SERVER_ARGS, Meta, SoakConfig, run_one, run_soak

# 20 s with a burst every 6 s (three bursts): at 35 s / 8 s (four bursts) the counts this test checks
# came out 20-50x over their floors (2274 requests: 523 stream disconnects >= 10, 2003 'length' >= 50,
# 573 exact ignore_eos >= 20, 160 429s > 0), so the shorter run still shows every kind and ending.
CI_SOAK = SoakConfig(duration_s=20.0, concurrency=10, burst_every_s=6.0, burst_size=40, seed=20251121)


@pytest.mark.parametrize("api_servers", [1, 2], ids=["one-api-server", "two-api-servers"])
def test_soak_every_request_ends_once_and_nothing_is_left(tmp_path, tiny_llama_dir, api_servers):
    # Two: the engine routes each request's outputs to its own API server process, admission is
    # split between them, and every counter is read through the shared metrics files.
    server = start_tiny_server(
        str(tmp_path), str(tiny_llama_dir), *DEFAULT_SERVER_ARGS, "--api-server-count", str(api_servers)
    )
    tree = process_tree(server.process.pid)
    try:
        report = asyncio.run(run_soak(server.base_url, CI_SOAK))
    finally:
        exit_code = server.stop(signal.SIGTERM, timeout=60)
    summary = report.summary()
    print(summary)
    assert not report.violations, summary

    # The mix really happened: every kind of request, and every kind of ending.
    kinds = {kind.split(":")[0] for kind in report.outcomes_by_kind}
    assert kinds >= {
        "stream", "nonstream", "stream_disconnect", "nonstream_disconnect",
        "deadline", "oversized", "bad_params", "burst",
    }, summary  # fmt: skip
    endings = {t for terminals in report.outcomes_by_kind.values() for t in terminals}
    assert endings >= {"completed", "client_disconnect", "error_status"}, summary
    assert report.outcomes_by_kind["stream_disconnect"].get("client_disconnect", 0) >= 10, summary
    assert report.outcomes_by_kind["oversized"] == {
        "error_status": report.outcomes_by_kind["oversized"]["error_status"]
    }
    assert report.finish_reasons.get("length", 0) >= 50, summary
    assert report.ignore_eos_exact >= 20, summary
    assert report.server_finished_by_reason.get("abort", 0) >= 10, summary  # disconnects were aborted
    assert report.server_finished_by_reason.get("error", 0) == 0, summary
    # Bursts met admission control (each 429 carried Retry-After and OpenAI's body: checked per request).
    assert report.num_429 > 0, summary
    assert report.idle_after_drain == {"running": 0.0, "waiting": 0.0, "kv_cache_usage_perc": 0.0}
    # The engine's own check: every block's ref count 0, free + evictable-cached = all blocks.
    assert report.engine_invariants == "ok", summary

    assert exit_code == 0, server.log()
    leaked = survivors(tree)
    assert not leaked, f"processes outlived the server: {leaked}"


def _run_against(handler, meta: Meta, body: dict) -> list[str]:
    async def go() -> list[str]:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://soak.test") as client:
            return (await run_one(client, meta, body, SoakConfig(request_timeout_s=5))).problems

    return asyncio.run(go())


def _sse(*events: str) -> httpx.Response:
    text = "".join(f"data: {e}\n\n" for e in events)
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_the_audit_catches_broken_answers():
    """The soak's checks can fail: each broken answer below is reported, a sound one is not."""
    chunk = '{"choices": [{"index": 0, "text": "x", "finish_reason": %s}]}'
    usage = '{"choices": [], "usage": {"completion_tokens": %d}}'
    stream = Meta(
        kind="stream", endpoint="completions", stream=True, max_tokens=4, ignore_eos=True, include_usage=True
    )
    body = {"prompt": "p", "stream": True}

    def problems(*events: str) -> list[str]:
        return _run_against(lambda _: _sse(*events), stream, body)

    assert problems(chunk % "null", chunk % '"length"', usage % 4, "[DONE]") == []
    assert any(
        "finished 2 times" in p for p in problems(chunk % '"length"', chunk % '"length"', usage % 4, "[DONE]")
    )
    assert any("never got a finish_reason" in p for p in problems(chunk % "null", usage % 4, "[DONE]"))
    assert any("[DONE] lines" in p for p in problems(chunk % '"length"', usage % 4))
    assert any("data after [DONE]" in p for p in problems(chunk % '"length"', usage % 4, "[DONE]", "[DONE]"))
    assert any("expected 4" in p for p in problems(chunk % '"length"', usage % 3, "[DONE]"))
    assert any("nobody aborted" in p for p in problems(chunk % '"abort"', usage % 1, "[DONE]"))
    error_event = '{"error": {"message": "boom", "type": "internal_error", "param": null, "code": 500}}'
    assert any("server error" in p for p in problems(error_event, "[DONE]"))

    plain = Meta(kind="nonstream", endpoint="completions", stream=False, max_tokens=4, ignore_eos=True)
    ok = {
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {"completion_tokens": 4},
    }
    assert _run_against(lambda _: httpx.Response(200, json=ok), plain, {"prompt": "p"}) == []
    short = {**ok, "usage": {"completion_tokens": 2}}
    assert any("expected 4" in p for p in _run_against(lambda _: httpx.Response(200, json=short), plain, {}))
    assert any(
        "server error 500" in p
        for p in _run_against(lambda _: httpx.Response(500, json={"error": {}}), plain, {})
    )
    not_openai = httpx.Response(429, json={"detail": "busy"})
    found = _run_against(lambda _: not_openai, plain, {})
    assert any("not {'error'" in p for p in found) and any("Retry-After" in p for p in found)
