"""One streaming request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.serve_metrics import RequestResult


def is_chat_endpoint(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def build_payload(
    req: SampleRequest,
    model: str,
    chat: bool,
    ignore_eos: bool,
    temperature: float,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        if not isinstance(req.prompt, str):
            raise TypeError("chat requests need text prompts; decode the token ids first")
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.expected_output_len
    else:
        payload["prompt"] = req.prompt
        payload["max_tokens"] = req.expected_output_len
    if ignore_eos:  # an extra field: sent only when asked, for servers that refuse unknown fields
        payload["ignore_eos"] = True
    if extra_body:
        payload.update(extra_body)
    return payload


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _chunk_finish_reason(chunk: dict[str, Any]) -> str | None:
    choices = chunk.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


async def _sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent event stream, as they arrive."""
    buffer = b""
    async for data in resp.content.iter_any():
        buffer = (buffer + data).replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:  # an event ends with a blank line
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip()


class _post_on_a_live_connection:
    """session.post, sent again once if the pooled keep-alive connection it went out on turns out
    closed by the server before any response came (llama-server's HTTP library closes idle
    connections; aiohttp then fails with "Can not write request body" or "Server disconnected"
    before the status line). Only a server that closed an idle connection does that, so it never
    ran the request and sending it again is safe; the time lost counts in the request's TTFT."""

    def __init__(self, session: aiohttp.ClientSession, url: str, payload: dict[str, Any], headers: dict[str, str]):
        self._send = lambda: session.post(url, json=payload, headers=headers)
        self._request: Any = None

    async def __aenter__(self) -> aiohttp.ClientResponse:
        self._request = self._send()
        try:
            return await self._request.__aenter__()
        except aiohttp.ServerDisconnectedError:
            pass
        except aiohttp.ClientOSError as exc:
            if "Can not write request body" not in str(exc):
                raise
        self._request = self._send()
        return await self._request.__aenter__()

    async def __aexit__(self, *exc_info: Any) -> None:
        await self._request.__aexit__(*exc_info)


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    headers: dict[str, str],
    prompt_len: int,
) -> RequestResult:
    """POST `payload` with stream=true and time its content chunks; a failure is recorded, not raised."""
    chat = "messages" in payload
    result = RequestResult(prompt_len=prompt_len)
    result.sent_monotonic = time.monotonic()
    start = last = time.perf_counter()
    result.start_time = start
    num_text_chunks = 0
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    saw_done = False
    try:
        async with _post_on_a_live_connection(session, url, payload, headers) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            async for body in _sse_data(resp):
                if body == b"[DONE]":
                    saw_done = True
                    continue
                chunk = json.loads(body)
                if result.response_id is None:
                    result.response_id = chunk.get("id")
                if "error" in chunk:
                    err = chunk["error"]
                    result.error = f"error chunk: {err.get('message', err) if isinstance(err, dict) else err}"
                    return result
                if text := _chunk_text(chunk, chat):
                    pieces.append(text)
                    now = time.perf_counter()
                    if num_text_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    num_text_chunks += 1
                if reason := _chunk_finish_reason(chunk):
                    result.finish_reason = reason
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.generated_text = "".join(pieces)
    if not saw_done:
        result.error = "stream ended without data: [DONE]"
        return result
    if num_text_chunks == 0:
        result.ttft = result.latency  # an empty completion: its only "token" is the end of the stream
    if usage is not None:
        result.output_tokens = int(usage.get("completion_tokens") or num_text_chunks)
        result.prompt_len = int(usage.get("prompt_tokens") or prompt_len)
    else:
        result.output_tokens = num_text_chunks
    result.success = True
    return result
