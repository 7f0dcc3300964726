"""Forwarding one HTTP exchange to a replica: headers both ways, the body relayed unbuffered, and a
stream that its replica cuts off ended with an OpenAI-style SSE error event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping

import httpx

# Hop-by-hop headers (RFC 9110, 7.6.1) and those the proxy recomputes never cross it.
_HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "host", "content-length",
}  # fmt: skip
# Asking for identity keeps the relayed bytes what the client can read without the replica's
# encoding negotiation; responses are small JSON or SSE.
_REQUEST_DROP = _HOP_BY_HOP | {"accept-encoding"}
_RESPONSE_DROP = _HOP_BY_HOP | {"date", "server"}

REPLICA_HEADER = "x-tokenmill-replica"  # which replica answered (for operators and tests)
SSE_DONE = b"data: [DONE]\n\n"


def request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _REQUEST_DROP}


def response_headers(headers: httpx.Headers, replica: str) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in _RESPONSE_DROP}
    out[REPLICA_HEADER] = replica
    return out


def error_body(message: str, status_code: int, error_type: str) -> dict:
    """OpenAI's error body, as the tokenmill server writes it."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status_code}}


def sse_error_event(message: str, status_code: int = 502, error_type: str = "bad_gateway") -> bytes:
    return b"data: " + json.dumps(error_body(message, status_code, error_type)).encode() + b"\n\n"


class UpstreamRelease:
    """Closes the replica's response and runs `on_close` once, whoever calls first: the relay when
    it ends, or the response's background task when the client left before the relay even started
    (an async generator never started never runs its `finally`)."""

    def __init__(self, response: httpx.Response, on_close: Callable[[], None]) -> None:
        self.response = response
        self.on_close = on_close
        self.done = False

    async def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        try:
            await self.response.aclose()  # the replica sees the disconnect and aborts the request
        finally:
            self.on_close()


async def relay(
    response: httpx.Response,
    replica: str,
    *,
    is_sse: bool,
    on_cut: Callable[[str], None],
    release: UpstreamRelease,
) -> AsyncIterator[bytes]:
    """The replica's body chunk by chunk as it arrives. If the replica goes away mid-body, an SSE
    stream ends with an error event and `data: [DONE]` (a partial event is closed first so the
    client's parser sees a well-formed event); `on_cut` hears why. `release` runs however it ends
    (the client leaving included)."""
    ends_event = True
    try:
        async for chunk in response.aiter_raw():
            if chunk:
                ends_event = chunk.endswith(b"\n\n")
                yield chunk
    except httpx.HTTPError as exc:
        reason = f"the replica {replica} failed mid-response: {type(exc).__name__}: {exc}"
        on_cut(reason)
        if is_sse:
            yield (b"" if ends_event else b"\n\n") + sse_error_event(reason) + SSE_DONE
    finally:
        await release()
