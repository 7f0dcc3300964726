"""A small proxy for disaggregated prefill / decode: each completion request is sent first to the
producer (`--kv-role producer`) with `max_tokens: 1`, which prefills it and ships its prompt's KV
blocks to the consumer, then unchanged to the consumer (`--kv-role consumer`), whose answer
(streamed or not) goes back to the client. docs/KV_OFFLOAD.md describes the engines.

A producer that fails or cannot be reached costs only time: the consumer computes the prompt
itself, so the client still gets the same answer. Everything else (`/v1/models`, `/health`, ...)
goes to the consumer.

    python -m tokenmill.server.disagg_proxy --producer http://127.0.0.1:8000 \
        --consumer http://127.0.0.1:8001 --port 9000
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

logger = logging.getLogger(__name__)

COMPLETION_ROUTES = ("/v1/completions", "/v1/chat/completions")
# Fields that would make the one-token prefill request invalid or wasteful.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "best_of")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The producer's request: the same prompt and options, one token, one choice, not streamed."""
    prefill = {key: value for key, value in body.items() if key not in _PREFILL_DROPPED}
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["max_tokens"] = 1
    prefill["stream"] = False
    prefill["n"] = 1
    return prefill


def make_app(producer: str, consumer: str, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), transport=transport)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):  # noqa: ANN202 - an async context manager
        yield
        await client.aclose()

    app = FastAPI(title="tokenmill disaggregation proxy", lifespan=lifespan)
    app.state.prefill_failures = 0

    async def prefill(path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        try:
            response = await client.post(producer + path, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            app.state.prefill_failures += 1
            logger.warning("producer %s unreachable (%s); the consumer computes the prompt", producer, exc)
            return
        if response.status_code != 200:
            app.state.prefill_failures += 1
            logger.warning(
                "producer answered %d (%s); the consumer computes the prompt", response.status_code, response.text[:200]
            )

    def forwarded_headers(request: Request) -> dict[str, str]:
        auth = request.headers.get("authorization")
        return {"authorization": auth} if auth else {}

    for route in COMPLETION_ROUTES:

        @app.post(route)
        async def completion(request: Request, _route: str = route) -> Response:
            body = await request.json()
            headers = forwarded_headers(request)
            if isinstance(body, dict):
                await prefill(_route, body, headers)
            if isinstance(body, dict) and body.get("stream"):
                upstream = await client.send(
                    client.build_request("POST", consumer + _route, json=body, headers=headers), stream=True
                )

                async def relay():  # noqa: ANN202 - an async byte iterator
                    try:
                        async for chunk in upstream.aiter_bytes():
                            yield chunk
                    finally:
                        await upstream.aclose()

                return StreamingResponse(
                    relay(), status_code=upstream.status_code, media_type=upstream.headers.get("content-type")
                )
            response = await client.post(consumer + _route, json=body, headers=headers)
            return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def passthrough(path: str, request: Request) -> Response:
        response = await client.request(
            request.method, f"{consumer}/{path}", content=await request.body(), headers=forwarded_headers(request)
        )
        return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--producer", required=True, help="base URL of the --kv-role producer server")
    parser.add_argument("--consumer", required=True, help="base URL of the --kv-role consumer server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args(argv)
    import uvicorn

    uvicorn.run(make_app(args.producer.rstrip("/"), args.consumer.rstrip("/")), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
