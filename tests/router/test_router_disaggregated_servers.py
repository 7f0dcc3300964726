"""Real `tokenmill serve --kv-role producer|consumer` processes behind `tokenmill router --prefill
--decode` (tiny checkpoint, CPU): greedy output through producer -> router -> consumer equals the
consumer computing the prompt alone, with the producer's blocks used every time (the consumer waits
for its transfer, so there is no race); then a killed producer (by pid, with a request in flight)
and a killed consumer (by pid, mid-stream): requests fail cleanly or are recomputed, and the
surviving engine holds no leaked KV block."""

from __future__ import annotations

import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.reliability.server_tools import engine_invariants, metric, start_tiny_server, wait_idle
from tests.router.fake_replica import serve_app
from tokenmill.router.app import Router, RouterSettings, create_router_app
from tokenmill.router.replicas import HealthSettings

PROMPTS = [f"tenant {i}: " + "the quick brown fox jumps over the lazy dog " * (4 + i) for i in range(3)]


def _body(prompt: str, **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}


def test_producer_router_consumer_equals_colocated_and_survives_killed_peers(tiny_llama_dir, tmp_path) -> None:
    address = f"ipc://{tmp_path}/kv"
    common = ("--enable-debug-endpoints", "--served-model-name", "tiny", "--kv-transfer-address", address)
    with ThreadPoolExecutor(2) as pool:  # both start at once (start-up is most of this test's time)
        starting = [
            pool.submit(start_tiny_server, str(tmp_path), str(tiny_llama_dir), "--kv-role", role, *extra, *common)
            for role, extra in (("consumer", ("--kv-transfer-wait", "3")), ("producer", ()))
        ]
        servers = [s.result() if s.exception() is None else None for s in starting]
    if None in servers:
        for server in servers:
            if server is not None:
                server.stop(signal.SIGKILL)
        raise next(s.exception() for s in starting if s.exception() is not None)
    consumer, producer = servers
    try:

        async def main() -> None:
            settings = RouterSettings(
                prefill=[producer.base_url], decode=[consumer.base_url],
                health=HealthSettings(interval_s=0.2, timeout_s=2.0),
            )  # fmt: skip
            server, task, url = await serve_app(create_router_app(Router(settings)), lifespan="on")
            try:
                async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                    await scenario(client)
            finally:
                server.should_exit = True
                await asyncio.wait_for(task, 10)

        async def scenario(client: httpx.AsyncClient) -> None:
            async with httpx.AsyncClient(base_url=consumer.base_url, timeout=60) as direct:
                for i, prompt in enumerate(PROMPTS):
                    # Colocated: the consumer computes it whole (the salt keeps every cache out).
                    alone = (await direct.post("/v1/completions", json=_body(prompt, cache_salt=f"alone{i}"))).json()
                    assert alone["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                    through = await client.post("/v1/completions", json=_body(prompt))
                    assert through.status_code == 200, through.text
                    answer = through.json()
                    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
                    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # every time: no race
                # Concurrent requests: each still waits for its own transfer and starts from it.
                fresh = [f"concurrent {i}: " + "a stitch in time saves nine " * (3 + i) for i in range(4)]
                answers = await asyncio.gather(*(client.post("/v1/completions", json=_body(p)) for p in fresh))
                for i, (prompt, answer) in enumerate(zip(fresh, answers, strict=True)):
                    alone = (await direct.post("/v1/completions", json=_body(prompt, cache_salt=f"c{i}"))).json()
                    assert answer.json()["choices"][0]["text"] == alone["choices"][0]["text"]
                    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                streamed = await client.post("/v1/completions", json=_body(PROMPTS[0], stream=True))
                assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
            assert metric(consumer.base_url, "kv_transfer_wait_timeouts_total") == 0
            # What the router pairs producers and consumers by.
            assert metric(consumer.base_url, "kv_transfer_info", kv_role="consumer", kv_transfer_address=address) == 1
            assert metric(producer.base_url, "kv_transfer_info", kv_role="producer", kv_transfer_address=address) == 1
            assert metric(consumer.base_url, "kv_transfer_hits_total") > 0

            # The producer dies (SIGKILL by pid) with a request in flight: it is recomputed on the consumer.
            pending = asyncio.create_task(client.post("/v1/completions", json=_body(PROMPTS[1] + " again")))
            await asyncio.sleep(0.05)
            producer.process.send_signal(signal.SIGKILL)
            answer = await pending
            assert answer.status_code == 200, answer.text
            after = await client.post("/v1/completions", json=_body(PROMPTS[2] + " later"))
            assert after.status_code == 200, after.text
            async with httpx.AsyncClient(base_url=consumer.base_url, timeout=60) as direct:
                alone = await direct.post("/v1/completions", json=_body(PROMPTS[2] + " later", cache_salt="x"))
            assert after.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
            wait_idle(consumer.base_url)
            assert engine_invariants(consumer.base_url) == "ok"

            # The consumer dies mid-stream: the client's stream ends with an error event, not a hang.
            async with client.stream(
                "POST", "/v1/completions", json=_body(PROMPTS[0], stream=True, max_tokens=200)
            ) as stream:
                chunks = stream.aiter_text()
                assert await anext(chunks)
                consumer.process.send_signal(signal.SIGKILL)
                rest = "".join([chunk async for chunk in chunks])
            assert '"code": 502' in rest.replace('"code":502', '"code": 502') and rest.endswith("data: [DONE]\n\n")

        asyncio.run(main())
    finally:
        for server in (producer, consumer):
            server.stop(signal.SIGKILL)
