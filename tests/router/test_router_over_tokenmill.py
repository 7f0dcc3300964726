"""The router in front of two real tokenmill API servers (the real HTTP stack over the scripted
fake engine of tests/server/fake_engine.py): streams and whole answers come through intact,
usage and all, /tokenize passes through, and the replicas' /metrics feed the router's load view."""

from __future__ import annotations

import asyncio
import contextlib

import httpx

from tests.reliability.fake_server import fake_server, sse_json
from tests.router.fake_replica import serve_app
from tests.server.fake_engine import MODEL, REPLY
from tokenmill.router.app import Router, RouterSettings, create_router_app
from tokenmill.router.proxy import REPLICA_HEADER
from tokenmill.router.replicas import HealthSettings


def test_the_router_relays_tokenmill_servers_intact() -> None:
    async def main() -> None:
        async with contextlib.AsyncExitStack() as stack:
            servers = [await stack.enter_async_context(fake_server(serve_http=True, max_model_len=512, num_kv_blocks=256)) for _ in range(2)]
            urls = [f"http://127.0.0.1:{s.port}" for s in servers]
            router = Router(RouterSettings(replicas=urls, health=HealthSettings(interval_s=0.05)))
            server, task, url = await serve_app(create_router_app(router), lifespan="on")
            try:
                async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                    system = "You answer questions about the fox. " * 4
                    body = {"model": MODEL, "messages": [{"role": "system", "content": system},
                                                         {"role": "user", "content": "go"}]}  # fmt: skip
                    streamed = await client.post(
                        "/v1/chat/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}}
                    )
                    assert streamed.status_code == 200, streamed.text
                    chunks = sse_json(streamed.text)
                    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
                    assert text == REPLY and chunks[-1]["usage"]["completion_tokens"] > 0
                    whole = await client.post("/v1/chat/completions", json=body)
                    assert whole.json()["choices"][0]["message"]["content"] == REPLY
                    # Same system prompt: same replica, and that replica's engine got both.
                    assert whole.headers[REPLICA_HEADER] == streamed.headers[REPLICA_HEADER]
                    tokens = await client.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
                    assert tokens.status_code == 200 and tokens.json()["tokens"]
                    # The router reads tokenmill's own load gauges from each replica's /metrics.
                    servers[0].state.metrics.update_engine_stats({"num_running": 3, "num_waiting": 2})
                    loads = router.balancer.load_of(urls[0])
                    for _ in range(100):
                        if (loads.running, loads.waiting) == (3, 2):
                            break
                        await asyncio.sleep(0.02)
                    assert (loads.running, loads.waiting) == (3, 2)
                    # The router's dashboard sums its replicas' /metrics: finished requests and
                    # output tokens equal what the two replicas' own dashboards report together.
                    await router.health.check_all()
                    page = await client.get("/dashboard")
                    assert page.status_code == 200 and "tokenmill router" in page.text
                    totals = (await client.get("/dashboard/data")).json()["totals"]
                    own = [(await s.client.get("/dashboard/data")).json()["totals"] for s in servers]
                    assert totals["requests_finished"] == sum(t["requests_finished"] for t in own) == 2
                    assert totals["output_tokens"] == sum(t["output_tokens"] for t in own) > 0
            finally:
                server.should_exit = True
                await asyncio.wait_for(task, 10)

    asyncio.run(asyncio.wait_for(main(), 30))
