"""`tokenmill serve`: FastAPI + uvicorn in this process, the engine core in a spawned one."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill import __version__
from tokenmill.dashboard import dashboard_router
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.metrics import METRICS_CONTENT_TYPE
from tokenmill.server.chat_prompt import render_chat_prompt
from tokenmill.server.lora_registry import RUNTIME_FLAG, LoRARegistry, LoRAUpdatingDisabledError
from tokenmill.server.openapi import document_request_bodies
from tokenmill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeResponse,
    parse_request,
    parse_tokenize_request,
)
from tokenmill.server.protocol_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from tokenmill.server.serving_chat import create_chat_completion
from tokenmill.server.serving_common import EventStream, tokenize_off_loop, wait_for_disconnect
from tokenmill.server.serving_completion import create_completion
from tokenmill.server.stall_watch import ClientStalled, StallWatch
from tokenmill.server.state import ServerState, ServiceUnavailableError

logger = logging.getLogger("tokenmill.server")

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
# The dashboard shows what /metrics shows (and the recent requests' timings, never their text), so
# it is open exactly when /metrics is: a browser opening the page sends no Authorization header.
# Exactly its routes' shapes: no other path (an odd spelling, "..") gets past the key this way.
DASHBOARD_PATH = re.compile(r"/dashboard(/data|/static/[A-Za-z0-9_-]+\.[a-z]+|/requests/[^/]+)?")


def is_open_path(path: str) -> bool:
    """Served without an API key: /health, /metrics, /version and the dashboard's routes."""
    if path in OPEN_PATHS:
        return True
    return DASHBOARD_PATH.fullmatch(path) is not None and not path.endswith(("/.", "/.."))


class PayloadTooLargeError(TokenmillError):
    status_code = 413
    error_type = "invalid_request_error"


class RequestTimeoutError(TokenmillError):
    status_code = 408
    error_type = "timeout_error"


class AuthenticationError(TokenmillError):
    status_code = 401
    error_type = "invalid_request_error"


class _NotFound(TokenmillError):
    status_code = 404
    error_type = "not_found_error"


class HeadersTooLargeError(TokenmillError):
    status_code = 431
    error_type = "invalid_request_error"


class _MethodNotAllowed(TokenmillError):
    status_code = 405
    error_type = "invalid_request_error"


# A refusal's status -> its `reason` in tokenmill:request_rejected_total. Every 4xx is decided before
# the request reaches the engine. 503 is not here: one that reaches the exception handler may be a
# request the engine had when it died; refusals with 503 are counted in ServerState.check_available.
REJECTION_REASON_BY_STATUS = {
    400: "invalid",
    401: "unauthorized",
    404: "not_found",
    405: "invalid",
    408: "timeout",
    413: "too_large",
    429: "queue_full",
    431: "too_large",
}


def count_rejection(state: ServerState, status_code: int) -> None:
    reason = REJECTION_REASON_BY_STATUS.get(status_code)
    if reason is not None:
        state.metrics.on_request_rejected(reason)


def error_response(exc: TokenmillError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else {}
    retry_after_s = getattr(exc, "retry_after_s", None)  # 429 overloaded, 503 queue time exceeded
    if retry_after_s is not None:
        headers["Retry-After"] = str(retry_after_s)
    if exc.status_code in (408, 413, 431):
        headers["Connection"] = "close"  # the rest of a half-read body must not be read as a request
    return JSONResponse(
        ErrorResponse.from_exception(exc).model_dump(), status_code=exc.status_code, headers=headers
    )


def is_authorized(scope: Scope, api_keys: tuple[str, ...]) -> bool:
    """True when the request carries `Authorization: Bearer <key>` for one of `api_keys` (each
    compared in constant time, all of them every time)."""
    header = b""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            header = value
            break
    scheme, _, token = header.strip().partition(b" ")
    # compare_digest's time depends only on the lengths, never on where the bytes differ; it
    # always runs, so a wrong scheme costs the same as a wrong key.
    token = token.strip()
    key_ok = False
    for api_key in api_keys:
        key_ok |= hmac.compare_digest(token, api_key.encode())
    return scheme.lower() == b"bearer" and key_ok


class HeaderLimitMiddleware:
    """Refuses requests whose target and headers exceed --max-header-bytes (431).

    h11's max_incomplete_event_size only bounds headers still arriving: a request line and
    headers that come whole in one read pass it at any size. This bounds what is accepted.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
            size += sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ()))
            if size > self.state.max_header_bytes:
                count_rejection(self.state, HeadersTooLargeError.status_code)
                response = error_response(
                    HeadersTooLargeError(
                        f"the request line and headers are {size} bytes; the limit is "
                        f"{self.state.max_header_bytes} bytes"
                    )
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ApiKeyMiddleware:
    """Refuses every route but /health, /metrics, /version and the dashboard without a key, before
    routing.

    It reads the ASGI `path` — the one routing uses — so no Host header, absolute request target
    or unusual spelling can reach a route around it: an unknown or odd path just needs the key too.
    """

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api_keys = self.state.api_keys
        if (
            not api_keys
            or scope["type"] not in ("http", "websocket")
            or (scope["type"] == "http" and is_open_path(scope["path"]))
            or is_authorized(scope, api_keys)
        ):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            count_rejection(self.state, AuthenticationError.status_code)
            await send({"type": "websocket.close", "code": 1008})
            return
        count_rejection(self.state, AuthenticationError.status_code)
        response = error_response(
            AuthenticationError(
                "invalid or missing API key; send the header 'Authorization: Bearer <key>'",
            )
        )
        await response(scope, receive, send)


# An oversize body is read on (and dropped) up to this much before the 413 goes out, so an
# ordinary client still uploading gets the answer instead of a reset connection.
DISCARD_LIMIT_BYTES = 64 * 2**20
DISCARD_TIMEOUT_S = 5.0
DISCARD_IDLE_S = 0.5


async def _discard_rest(chunks: AsyncIterator[bytes], already: int) -> None:
    """Drops what the client is still sending, while it keeps coming: stops after DISCARD_LIMIT_BYTES,
    DISCARD_TIMEOUT_S in all, or a pause of DISCARD_IDLE_S (a client that stalls gets its 413 then)."""
    deadline = asyncio.get_running_loop().time() + DISCARD_TIMEOUT_S
    with contextlib.suppress(TimeoutError, ClientDisconnect, StopAsyncIteration):
        while already <= DISCARD_LIMIT_BYTES:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return
            chunk = await asyncio.wait_for(chunks.__anext__(), min(DISCARD_IDLE_S, left))
            if not chunk:
                return
            already += len(chunk)


async def read_body(state: ServerState, request: Request) -> bytes:
    """The request body, at most --max-body-bytes (else 413), read within --client-read-timeout
    (else 408), so a client that sends too much or too slowly cannot hold the server's memory
    or a connection forever."""
    declared = request.headers.get("content-length")
    stream = request.stream().__aiter__()
    if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
        await _discard_rest(stream, 0)
        raise PayloadTooLargeError(
            f"the request body is {declared} bytes; the limit is {state.max_body_bytes} bytes"
        )
    chunks = []
    size = 0
    too_large = False
    try:
        async with asyncio.timeout(state.client_read_timeout):
            async for chunk in stream:
                size += len(chunk)
                if size > state.max_body_bytes:
                    too_large = True
                    break
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeoutError(
            f"the request body was not received within {state.client_read_timeout:g} s "
            f"({size} bytes arrived); send it faster"
        ) from None
    if too_large:
        await _discard_rest(stream, size)
        raise PayloadTooLargeError(f"the request body exceeds the limit of {state.max_body_bytes} bytes")
    return b"".join(chunks)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tokenmill", version=__version__, root_path=state.root_path)
    app.state.tm = state
    document_request_bodies(app)
    app.add_middleware(ApiKeyMiddleware, state=state)
    app.add_middleware(HeaderLimitMiddleware, state=state)
    if state.cors is not None:  # added last, runs first: a browser's preflight carries no API key
        cors = state.cors
        app.add_middleware(
            CORSMiddleware, allow_origins=list(cors.allowed_origins), allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers), allow_credentials=cors.allow_credentials,
        )  # fmt: skip

    @app.exception_handler(TokenmillError)
    async def _tokenmill_error(_: Request, exc: TokenmillError):
        if exc.status_code >= 500:
            logger.error("request failed: %s", exc.message)
        if not getattr(exc, "reached_engine", False):  # a shed request was admitted: the engine counts it
            count_rejection(state, exc.status_code)
        return error_response(exc)

    @app.exception_handler(404)
    async def _not_found(request: Request, _exc: Any):
        count_rejection(state, _NotFound.status_code)
        return error_response(_NotFound(f"no route for {request.method} {request.url.path}"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, exc: Any):
        count_rejection(state, _MethodNotAllowed.status_code)
        response = error_response(_MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}"))
        # Routing put the route's methods in `Allow`, which a 405 must carry (RFC 9110, 15.5.6).
        response.headers.update(getattr(exc, "headers", None) or {})
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.error("unexpected error while serving a request", exc_info=exc)
        return error_response(TokenmillError(f"internal error: {type(exc).__name__}: {exc}"))

    @app.get("/health")
    async def health() -> Response:
        if state.ready and not state.draining and not state.engine.dead:
            return Response(status_code=200)
        reason = (
            state.startup_error
            or state.engine.dead
            or ("shutting down" if state.draining else "the engine is starting")
        )
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    if state.enable_debug_endpoints:

        @app.get("/debug/invariants")
        async def debug_invariants() -> dict[str, Any]:
            """The engine's own consistency check: queues agree with the requests, every KV block's
            ref count equals its holders, and with nothing live every block is free or cached."""
            state.check_available()
            try:
                stats = await state.engine.call_utility("check_invariants")
            except RuntimeError as exc:  # the engine answered: an invariant is broken
                raise TokenmillError(f"engine invariant violated: {exc}") from exc
            return {"ok": True, "stats": stats}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    if state.dashboard is not None:
        app.include_router(dashboard_router(state.dashboard, state.recent_requests, title=f"tokenmill · {state.model_names[0]}"))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        info = state.engine.info
        max_model_len = info.max_model_len if info else None
        cards = [ModelCard(id=name, root=state.model_root, max_model_len=max_model_len) for name in state.model_names]
        for adapter in state.lora.adapters if state.lora is not None else ():
            lora = adapter.request
            cards.append(ModelCard(id=lora.lora_name, root=lora.lora_path, parent=adapter.parent, max_model_len=max_model_len))
        return ModelList(data=cards).model_dump()

    # In the schema only where they are served; elsewhere they answer 404 naming the flag that serves them.
    runtime_lora = state.lora is not None and state.lora.allow_runtime_updating

    @app.post("/v1/load_lora_adapter", include_in_schema=runtime_lora)
    async def load_lora_adapter(request: Request) -> Response:
        """vLLM's: {"lora_name", "lora_path"}; the adapter is checked against the base model before it
        is served (400 naming the problem), a path outside --lora-allowed-dirs is 403."""
        registry = _runtime_lora(state)
        state.check_available()
        body = parse_request(LoadLoRAAdapterRequest, await read_body(state, request))
        await registry.load(state.engine, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", include_in_schema=runtime_lora)
    async def unload_lora_adapter(request: Request) -> Response:
        """vLLM's: {"lora_name"}. 409 while requests using the adapter are in flight: finish or cancel
        them first. The adapter's cached KV blocks are never reused: a later load gets a new id."""
        registry = _runtime_lora(state)
        state.check_available()
        body = parse_request(UnloadLoRAAdapterRequest, await read_body(state, request))
        await registry.unload(state.engine, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        state.check_available()
        body = parse_tokenize_request(await read_body(state, request))
        state.check_model(body.model)
        tokenizer = state.tokenizer("messages" if isinstance(body, TokenizeChatRequest) else "prompt")

        def tokenize_body() -> tuple[list[int], list[str] | None]:
            if isinstance(body, TokenizeChatRequest):
                tokens = render_chat_prompt(state, body).token_ids
            else:
                tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            return tokens, tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None

        # Up to --max-body-bytes of text takes seconds to tokenize: off the event loop, as for
        # completions, so the streams being served meanwhile do not stall.
        if isinstance(body, TokenizeChatRequest):
            num_chars = sum(len(m.text()) for m in body.messages)
        else:
            num_chars = len(body.prompt)
        tokens, strs = await tokenize_off_loop(num_chars, tokenize_body)
        return TokenizeResponse(
            count=len(tokens), max_model_len=state.max_model_len, tokens=tokens, token_strs=strs
        ).model_dump(exclude_none=True)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        state.check_available()
        body = parse_request(DetokenizeRequest, await read_body(state, request))
        state.check_model(body.model)
        vocab = state.engine.info.vocab_size  # type: ignore[union-attr]
        bad = [t for t in body.tokens if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"token ids must be < the vocabulary size {vocab}, got {bad[0]}", param="tokens"
            )
        # ~4 characters a token: the same bound as for text before decoding leaves the event loop.
        text = await tokenize_off_loop(4 * len(body.tokens), state.tokenizer("tokens").decode, body.tokens)
        return DetokenizeResponse(prompt=text).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        received = time.monotonic()
        state.check_available()
        body = parse_request(CompletionRequest, await read_body(state, request))
        trace = state.trace_context(request.headers, received, body.model)
        return await _respond(
            request, create_completion(state, body, trace, received), body.stream, state.stream_write_timeout
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        received = time.monotonic()
        state.check_available()
        body = parse_request(ChatCompletionRequest, await read_body(state, request))
        trace = state.trace_context(request.headers, received, body.model)
        return await _respond(
            request, create_chat_completion(state, body, trace, received), body.stream, state.stream_write_timeout
        )

    return app


def _runtime_lora(state: ServerState) -> LoRARegistry:
    """The registry, when this server loads and unloads adapters at runtime; else 404 naming the flags."""
    if state.lora is None:
        raise LoRAUpdatingDisabledError(
            f"LoRA is off on this server; start it with --enable-lora and {RUNTIME_FLAG} to load adapters at runtime"
        )
    state.lora.check_runtime_updating()
    return state.lora


class _EventStreamResponse(StreamingResponse):
    """An SSE response that closes its events however it ends — finished, client gone, client
    stalled, server stopping, or cancelled before the first event — so the request is aborted in
    the engine and its admission released now, not whenever the garbage collector runs.

    A client that stops reading while staying connected would otherwise hold its request (and the
    connection) forever once the socket buffers fill: a write that cannot proceed for
    `write_timeout` seconds ends the stream and the connection instead."""

    def __init__(self, events: EventStream, write_timeout: float | None = None) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events = events
        self.write_timeout = write_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.write_timeout
        watch = StallWatch(timeout) if timeout else None

        async def send_or_give_up(message: Any) -> None:
            await watch.send(send, message)  # type: ignore[union-attr]

        try:
            await super().__call__(scope, receive, send_or_give_up if watch is not None else send)
        except* ClientStalled:
            client = scope.get("client")
            logger.warning(
                "closing the stream to %s: it read nothing for %g s (--stream-write-timeout)",
                f"{client[0]}:{client[1]}" if client else "a client",
                timeout,
            )
        finally:
            if watch is not None:
                watch.close()
            await self.events.aclose()


async def _respond(
    request: Request, handler: Awaitable[Any], stream: bool, stream_write_timeout: float | None = None
) -> Response:
    if stream:
        events = await handler  # validation and admission errors raise here, before any byte is sent
        return _EventStreamResponse(events, stream_write_timeout)
    # Non-streaming: race the work against the client leaving; leaving cancels the work,
    # which aborts the request in the engine.
    work = asyncio.ensure_future(handler)
    gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # this handler itself cancelled (server shutting down): take the work with it
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
        gone.cancel()
    if work.cancelled():
        return Response(status_code=499)  # nobody is listening; the status only shows in logs
    return Response(work.result().model_dump_json(), media_type="application/json")


def __getattr__(name: str) -> Any:
    # The server launch lives in launch.py, which imports create_app from here; re-exported
    # lazily so `from tokenmill.server.api_server import build_server, run_server, drain` works.
    if name in ("build_server", "run_server", "drain"):
        from tokenmill.server import launch

        return getattr(launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["create_app", "ServiceUnavailableError"]  # and, lazily, build_server, run_server, drain
