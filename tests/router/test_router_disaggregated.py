"""`tokenmill router --prefill URL --decode URL` over scripted replicas: the prefill server gets a
one-token copy naming a fresh transfer id, the decode server the client's request naming the same
id and its stream goes to the client; a dead prefill server costs only the prefill (the decode
server computes the prompt); health, metrics and the other routes in this mode."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from tests.router.fake_replica import FakeReplica, serve_app
from tests.router.test_router_http import chat, metric
from tokenmill.router.app import Router, RouterSettings, create_router_app
from tokenmill.router.proxy import REPLICA_HEADER
from tokenmill.router.replicas import HealthSettings


@contextlib.asynccontextmanager
async def pd_rig(num_prefill: int = 2, num_decode: int = 1, paired: bool = False):
    """`paired`: prefill server i sends its KV to decode server i (their /metrics say so)."""
    prefill = [FakeReplica(f"p{i}", kv_transfer=("producer", f"ipc://kv{i}") if paired else None) for i in range(num_prefill)]
    decode = [FakeReplica(f"d{i}", kv_transfer=("consumer", f"ipc://kv{i}") if paired else None) for i in range(num_decode)]
    for replica in prefill + decode:
        await replica.start()
    settings = RouterSettings(
        prefill=[r.url for r in prefill], decode=[r.url for r in decode],
        health=HealthSettings(interval_s=0.05, timeout_s=1.0, failure_threshold=2),
    )  # fmt: skip
    router = Router(settings)
    server, task, url = await serve_app(create_router_app(router), lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield client, prefill, decode
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        for replica in prefill + decode:
            await replica.stop()


def run(scenario, **kwargs) -> None:
    async def main() -> None:
        async with pd_rig(**kwargs) as rig:
            await asyncio.wait_for(scenario(*rig), 20)

    asyncio.run(main())


def test_prefill_then_decode_with_one_transfer_id_and_the_stream_relayed() -> None:
    async def scenario(client, prefill, decode) -> None:
        body = chat("system", "hi", stream=True, max_completion_tokens=9, n=1, stream_options={"include_usage": True})
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200 and response.headers[REPLICA_HEADER] == decode[0].url
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert [e["replica"] for e in events] == ["d0"] * 4 and response.text.endswith("data: [DONE]\n\n")
        [sent] = [r.seen[0] for r in prefill if r.seen]
        transfer = sent.pop("kv_transfer_params")
        assert transfer["transfer_id"].startswith("pd-")
        assert sent == {k: v for k, v in body.items() if k != "stream_options"} | {
            "max_completion_tokens": 1, "max_tokens": 1, "stream": False, "n": 1,
        }  # fmt: skip
        assert decode[0].seen == [body | {"kv_transfer_params": transfer}]
        # A second request gets its own transfer id.
        await client.post("/v1/completions", json={"model": "tiny", "prompt": "other", "max_tokens": 3})
        ids = {r["kv_transfer_params"]["transfer_id"] for r in decode[0].seen}
        assert len(ids) == 2
        text = (await client.get("/metrics")).text
        assert metric(text, "tokenmill_router:pd_prefills_total", outcome="ok") == 2

    run(scenario)


def test_a_dead_prefill_server_is_retried_and_without_any_the_decode_server_computes() -> None:
    async def scenario(client, prefill, decode) -> None:
        prefill[0].kill()
        for i in range(3):
            response = await client.post("/v1/chat/completions", json=chat(f"tenant {i}", "hi"))
            assert response.status_code == 200 and response.headers[REPLICA_HEADER] == decode[0].url
        assert all("kv_transfer_params" in r for r in decode[0].seen)  # p1 prefilled them all
        prefill[1].kill()
        response = await client.post("/v1/chat/completions", json=chat("tenant 9", "hi"))
        assert response.status_code == 200
        assert "kv_transfer_params" not in decode[0].seen[-1]  # no transfer to wait for
        text = (await client.get("/metrics")).text
        assert metric(text, "tokenmill_router:pd_prefills_total", outcome="failed") == 1
        health = await client.get("/health")
        assert health.status_code == 200  # the decode server still answers
        report = health.json()
        assert report["mode"] == "disaggregated"
        assert {r["role"] for r in report["replicas"].values()} == {"prefill", "decode"}
        decode[0].kill()
        async def unhealthy() -> bool:
            return (await client.get("/health")).status_code == 503

        for _ in range(100):
            if await unhealthy():
                break
            await asyncio.sleep(0.02)
        assert await unhealthy()

    run(scenario)


def test_a_refused_prefill_reaches_the_client_and_other_routes_go_to_decode() -> None:
    async def scenario(client, prefill, decode) -> None:
        for replica in prefill:
            replica.fail_status = 400
        response = await client.post("/v1/chat/completions", json=chat("s", "hi"))
        assert response.status_code == 400 and decode[0].seen == []
        own = await client.post("/v1/chat/completions", json=chat("s", "hi", kv_transfer_params={"transfer_id": "x"}))
        assert own.status_code == 400 and "kv_transfer_params" in own.text
        models = await client.get("/v1/models")
        assert models.json()["data"][0]["root"] == "d0"

    run(scenario, num_prefill=1)


def test_each_decode_goes_to_the_consumer_its_producer_feeds() -> None:
    """Two producer / consumer pairs (each producer sends to its own consumer's address): whatever
    the policy picks for the prefill, the decode goes to that producer's consumer; when that
    consumer is down, the other computes the prompt without waiting for a transfer."""

    async def scenario(client, prefill, decode) -> None:
        for i in range(8):
            response = await client.post("/v1/chat/completions", json=chat(f"tenant {i}: " + "x" * 200, "hi"))
            assert response.status_code == 200
        for p, d in zip(prefill, decode, strict=True):
            sent = {r["kv_transfer_params"]["transfer_id"] for r in p.seen}
            assert sent == {r["kv_transfer_params"]["transfer_id"] for r in d.seen}
        assert all(p.seen for p in prefill)  # both pairs were used
        decode[1].kill()
        for _ in range(100):
            if not (await client.get("/health")).json()["replicas"][decode[1].url]["healthy"]:
                break
            await asyncio.sleep(0.02)
        prefill[0].healthy = False  # p1 prefills from now on
        for _ in range(100):
            if not (await client.get("/health")).json()["replicas"][prefill[0].url]["healthy"]:
                break
            await asyncio.sleep(0.02)
        before = len(decode[0].seen)
        response = await client.post("/v1/chat/completions", json=chat("tenant 99", "hi"))
        assert response.status_code == 200 and response.headers[REPLICA_HEADER] == decode[0].url
        assert len(decode[0].seen) == before + 1 and "kv_transfer_params" not in decode[0].seen[-1]

    run(scenario, num_prefill=2, num_decode=2, paired=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill": ["http://a"]}, "at least one --prefill URL and one --decode URL"),
        ({"replicas": ["http://a"], "prefill": ["http://b"], "decode": ["http://c"]}, "not both"),
        ({"prefill": ["http://a"], "decode": ["http://a"]}, "repeats a URL"),
    ],
)
def test_bad_disaggregated_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterSettings(**kwargs)


def test_the_cli_flags_select_the_mode() -> None:
    from tokenmill.cli import build_parser
    from tokenmill.router.launch import settings_from_args

    def settings(*argv: str) -> RouterSettings:
        return settings_from_args(build_parser().parse_args(["router", *argv]))

    pd = settings("--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:1", "--decode", "http://d:2")
    assert pd.disaggregated and pd.prefill == ["http://p:1"] and pd.decode == ["http://d:1", "http://d:2"]
    assert settings("--prefill", "http://p:1", "--decode", "http://d:1").disaggregated  # implied
    assert not settings("--replica", "http://r:1").disaggregated
    with pytest.raises(ValueError, match="--pd-disaggregation needs"):
        settings("--pd-disaggregation", "--prefill", "http://p:1")
    with pytest.raises(ValueError, match="give at least one --replica URL"):
        settings()
