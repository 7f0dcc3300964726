"""`tokenmill serve`: FastAPI + uvicorn in this process, the engine core in a spawned one."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import signal
import sys
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenmill import __version__
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.metrics import METRICS_CONTENT_TYPE, ServerMetrics
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
from tokenmill.server.serving_chat import create_chat_completion
from tokenmill.server.serving_common import wait_for_disconnect
from tokenmill.server.serving_completion import create_completion
from tokenmill.server.state import ServerState, ServiceUnavailableError

logger = logging.getLogger("tokenmill.server")

OPEN_PATHS = frozenset({"/health", "/metrics"})


class PayloadTooLargeError(TokenmillError):
    status_code = 413
    error_type = "invalid_request_error"


class AuthenticationError(TokenmillError):
    status_code = 401
    error_type = "invalid_request_error"


def error_response(exc: TokenmillError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return JSONResponse(
        ErrorResponse.from_exception(exc).model_dump(), status_code=exc.status_code, headers=headers
    )


async def read_body(state: ServerState, request: Request) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > state.max_body_bytes:
        raise PayloadTooLargeError(f"request body is {declared} bytes; the limit is {state.max_body_bytes}")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > state.max_body_bytes:
            raise PayloadTooLargeError(f"request body exceeds the limit of {state.max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tokenmill", version=__version__)
    app.state.tm = state

    @app.middleware("http")
    async def guard(request: Request, call_next):
        # Every route but /health and /metrics needs the key; the raw ASGI path is what routing
        # uses, so no Host header or absolute-URL trick can reach a route around this check.
        if state.api_key is not None and request.scope["path"] not in OPEN_PATHS:
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), state.api_key.encode()
            ):
                return error_response(
                    AuthenticationError("invalid or missing API key; send 'Authorization: Bearer <key>'")
                )
        try:
            return await call_next(request)
        except TokenmillError as exc:
            return error_response(exc)

    @app.exception_handler(TokenmillError)
    async def _tokenmill_error(_: Request, exc: TokenmillError):
        if exc.status_code >= 500:
            logger.error("request failed: %s", exc.message)
        return error_response(exc)

    @app.exception_handler(404)
    async def _not_found(request: Request, _exc: Any):
        return error_response(_NotFound(f"no route for {request.method} {request.url.path}"))

    @app.exception_handler(405)
    async def _bad_method(request: Request, _exc: Any):
        return error_response(_MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unexpected error while serving a request")
        return error_response(TokenmillError(f"internal error: {type(exc).__name__}"))

    @app.get("/health")
    async def health() -> Response:
        if state.ready and not state.draining and not state.engine.dead:
            return Response(status_code=200)
        reason = state.startup_error or state.engine.dead or ("draining" if state.draining else "starting")
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        cards = [
            ModelCard(id=name, root=state.model_root, max_model_len=state.max_model_len)
            for name in state.model_names
        ]
        return ModelList(data=cards).model_dump()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        state.check_available()
        body = parse_tokenize_request(await read_body(state, request))
        state.check_model(body.model)
        tokenizer = state.engine.tokenizer
        if isinstance(body, TokenizeChatRequest):
            from tokenmill.engine.chat_template import render_chat

            tokens = render_chat(
                tokenizer,
                body.messages_for_template(),
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template_kwargs=body.chat_template_kwargs,
            )
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        strs = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
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
        return DetokenizeResponse(prompt=state.engine.tokenizer.decode(body.tokens)).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        state.check_available()
        body = parse_request(CompletionRequest, await read_body(state, request))
        return await _respond(request, create_completion(state, body), body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.check_available()
        body = parse_request(ChatCompletionRequest, await read_body(state, request))
        return await _respond(request, create_chat_completion(state, body), body.stream)

    async def _respond(request: Request, handler, stream: bool):
        if stream:
            events = await handler  # validation errors raise here, before any byte is sent
            return StreamingResponse(
                events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        # Non-streaming: race the work against the client leaving; leaving cancels the work,
        # which aborts the request in the engine.
        work = asyncio.ensure_future(handler)
        gone = asyncio.ensure_future(wait_for_disconnect(request.receive))
        finished, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work not in finished:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)
        gone.cancel()
        return JSONResponse(work.result().model_dump(exclude_none=False))

    return app


class _NotFound(TokenmillError):
    status_code = 404
    error_type = "not_found_error"


class _MethodNotAllowed(TokenmillError):
    status_code = 405
    error_type = "invalid_request_error"


class _DrainingServer(uvicorn.Server):
    """uvicorn that drains on SIGINT / SIGTERM: stop admitting, let in-flight requests finish up to
    the shutdown timeout, abort the rest (finish_reason "abort"), then exit. A second signal exits now."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.tm_state = state
        self.shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_task is not None or not self.tm_state.ready:
            self.should_exit = True
            self.force_exit = self._drain_task is not None
            return
        logger.info("received %s: draining (up to %.0f s)", signal.Signals(sig).name, self.shutdown_timeout)
        self.tm_state.draining = True
        self._drain_task = asyncio.get_event_loop().create_task(self._drain())

    async def _drain(self) -> None:
        engine = self.tm_state.engine
        deadline = asyncio.get_event_loop().time() + self.shutdown_timeout
        while engine.num_unfinished and asyncio.get_event_loop().time() < deadline and not engine.dead:
            await asyncio.sleep(0.05)
        if engine.num_unfinished and not engine.dead:
            logger.warning(
                "aborting %d requests still running after the shutdown timeout", engine.num_unfinished
            )
            await engine.abort_all()
            grace = asyncio.get_event_loop().time() + 2.0
            while engine.num_unfinished and asyncio.get_event_loop().time() < grace:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)  # let the last chunks flush
        self.should_exit = True


def run_server(args: argparse.Namespace) -> int:
    from tokenmill.cli import engine_kwargs_from_args
    from tokenmill.engine.llm import build_engine_config

    config = build_engine_config(args.model, **engine_kwargs_from_args(args))
    model_root = args.model or "SmolLM2-135M-Instruct"
    names = [n for n in (args.served_model_name or "").split(",") if n] or [model_root]
    api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY")
    state = ServerState(
        engine=AsyncEngine(config),
        model_names=names,
        model_root=model_root,
        metrics=ServerMetrics(names[0]),
        api_key=api_key,
        max_n=args.max_n,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
    )
    app = create_app(state)
    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="off"
    )
    server = _DrainingServer(uv_config, state, args.shutdown_timeout)
    return asyncio.run(_serve(server, state))


async def _serve(server: _DrainingServer, state: ServerState) -> int:
    async def start_engine() -> None:
        try:
            await state.engine.start()
        except Exception as exc:
            state.startup_error = str(exc)
            logger.error("engine start-up failed: %s", exc)
            server.should_exit = True
            return
        state.engine.on_step_stats = state.metrics.update_engine_stats
        state.engine.on_output = state.observe_output
        state.ready = True
        logger.info(
            "tokenmill %s ready on http://%s:%d (model %s)",
            __version__,
            server.config.host,
            server.config.port,
            state.model_names[0],
        )
        print(
            f"tokenmill ready on http://{server.config.host}:{server.config.port}",
            file=sys.stderr,
            flush=True,
        )

    starter = asyncio.create_task(start_engine())
    try:
        await server.serve()
    finally:
        starter.cancel()
        await asyncio.gather(starter, return_exceptions=True)
        await state.engine.shutdown()
    return 1 if state.startup_error else 0


def _json(obj: Any) -> str:
    return json.dumps(obj)


__all__ = ["create_app", "run_server", "ServiceUnavailableError"]
