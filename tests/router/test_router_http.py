"""`tokenmill router` over scripted replicas: affinity, balancing, sessions, retries after a replica
dies, stream cut-offs, health checks, its /metrics and /health."""

from __future__ import annotations

import asyncio
import json
import time

from tests.router.fake_replica import NUM_CHUNKS, RouterRig, run
from tokenmill.router.proxy import REPLICA_HEADER
from tokenmill.router.replicas import HealthSettings

SYSTEM = "You are the support assistant of Example Corp. " * 12  # ~600 characters shared


def chat(system: str, question: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], **extra}


async def post(rig: RouterRig, payload: dict, headers: dict | None = None) -> str:
    """The replica that answered (the router names it in a header)."""
    response = await rig.client.post("/v1/chat/completions", json=payload, headers=headers or {})
    assert response.status_code == 200, response.text
    return response.headers[REPLICA_HEADER]


async def wait_until(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        named = line.startswith((name + "{", name + " "))
        if named and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_shared_prefix_requests_stick_to_one_replica_and_distinct_ones_spread() -> None:
    async def scenario(rig: RouterRig) -> None:
        shared = {await post(rig, chat(SYSTEM, f"question {i}")) for i in range(6)}
        assert len(shared) == 1, shared
        distinct = [await post(rig, chat(f"tenant {i}: " + "policy text " * 50, "hi")) for i in range(6)]
        assert len(set(distinct)) == 2 and min(distinct.count(u) for u in set(distinct)) >= 2, distinct
        text = (await rig.client.get("/metrics")).text
        assert metric(text, "tokenmill_router:affinity_hits_total") >= 5
        assert metric(text, "tokenmill_router:affinity_queries_total") == 12
        hit_rate = metric(text, "tokenmill_router:affinity_hit_rate")
        assert hit_rate == metric(text, "tokenmill_router:affinity_hits_total") / 12

    run(scenario)


def test_round_robin_ignores_the_prefix() -> None:
    async def scenario(rig: RouterRig) -> None:
        replicas = [await post(rig, chat(SYSTEM, f"question {i}")) for i in range(4)]
        assert len(set(replicas)) == 2 and replicas[0] != replicas[1], replicas

    run(scenario, policy="round_robin")


def test_concurrent_distinct_prompts_are_balanced_by_in_flight_load() -> None:
    async def scenario(rig: RouterRig) -> None:
        replicas = await asyncio.gather(*(post(rig, chat(f"tenant {i} " * 40, "hi", stream=False)) for i in range(8)))
        counts = sorted(replicas.count(u) for u in set(replicas))
        assert counts == [4, 4], counts

    run(scenario, chunk_s=0.05)


def test_reported_load_outweighs_affinity_past_the_thresholds() -> None:
    async def scenario(rig: RouterRig) -> None:
        owner = await post(rig, chat(SYSTEM, "first"))
        rig.replica(owner).extra_waiting = 40  # another client's backlog on the owner
        await wait_until(lambda: rig.router.balancer.load_of(owner).waiting == 40)
        assert await post(rig, chat(SYSTEM, "second")) != owner
        text = (await rig.client.get("/metrics")).text
        assert metric(text, "tokenmill_router:replica_num_requests_waiting", replica=owner) == 40
        assert metric(text, "tokenmill_router:requests_total", reason="load_balance") == 1

    run(scenario)


def test_a_session_stays_on_its_replica() -> None:
    async def scenario(rig: RouterRig) -> None:
        by_header = {await post(rig, chat(f"topic {i}", "x"), {"X-Session-Id": "s1"}) for i in range(5)}
        assert len(by_header) == 1
        by_user = {await post(rig, chat(f"other {i}", "y", user="alice")) for i in range(5)}
        assert len(by_user) == 1
        spread = {await post(rig, chat("same", "z"), {"X-Session-Id": f"s-{i}"}) for i in range(4)}
        assert len(spread) == 2  # round robin among new sessions

    run(scenario, policy="round_robin")


def test_requests_not_started_on_a_dead_replica_complete_elsewhere() -> None:
    async def scenario(rig: RouterRig) -> None:
        owner = await post(rig, chat(SYSTEM, "warm up"))
        dead = rig.replica(owner)
        # In flight but not answered yet (non-streaming: nothing reaches the client until the end).
        pending = [asyncio.create_task(post(rig, chat(SYSTEM, f"pending {i}"))) for i in range(3)]
        await wait_until(lambda: len(dead.seen) == 4)
        dead.kill()
        # Routed there by affinity after the kill, before any health check noticed: refused, retried.
        later = [await post(rig, chat(SYSTEM, f"later {i}")) for i in range(2)]
        answered = await asyncio.gather(*pending)
        assert owner not in answered + later, (owner, answered, later)
        text = (await rig.client.get("/metrics")).text
        assert metric(text, "tokenmill_router:retries_total", replica=owner) >= 3
        assert metric(text, "tokenmill_router:replica_healthy", replica=owner) == 0

    # Health checks slower than the test: only the forwarding path can notice the death.
    run(scenario, chunk_s=0.1, health=HealthSettings(interval_s=30, timeout_s=1, failure_threshold=2))


def test_a_stream_cut_by_its_replica_ends_with_an_error_event() -> None:
    async def scenario(rig: RouterRig) -> None:
        async with rig.client.stream("POST", "/v1/chat/completions", json=chat(SYSTEM, "go", stream=True)) as response:
            assert response.status_code == 200
            owner = response.headers[REPLICA_HEADER]
            started = time.monotonic()
            body = b""
            async for chunk in response.aiter_raw():
                if not body:  # unbuffered: the first event arrives long before the replica is done
                    assert time.monotonic() - started < 0.5 * NUM_CHUNKS * 0.3
                    rig.replica(owner).kill()
                body += chunk
        events = [e for e in body.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert owner in error["message"] and error["code"] == 502, error
        assert json.loads(events[0].removeprefix("data: "))["i"] == 0
        text = (await rig.client.get("/metrics")).text
        assert metric(text, "tokenmill_router:stream_errors_total", replica=owner) == 1
        # The next request goes to the survivor.
        assert await post(rig, chat(SYSTEM, "after")) != owner

    run(scenario, chunk_s=0.3)


def test_health_checks_drop_and_readmit_a_replica() -> None:
    async def scenario(rig: RouterRig) -> None:
        sick = rig.replicas[0]
        sick.healthy = False
        await wait_until(lambda: not rig.router.balancer.is_healthy(sick.url))
        health = (await rig.client.get("/health")).json()
        assert health["replicas"][sick.url]["healthy"] is False and "503" in health["replicas"][sick.url]["last_error"]
        assert {await post(rig, chat(f"t{i}", "x")) for i in range(4)} == {rig.replicas[1].url}
        sick.healthy = True
        await wait_until(lambda: rig.router.balancer.is_healthy(sick.url))
        assert sick.url in {await post(rig, chat(f"u{i}", "x")) for i in range(4)}
        text = (await rig.client.get("/metrics")).text
        assert metric(text, "tokenmill_router:replica_health_transitions_total", replica=sick.url, to="down") == 1
        assert metric(text, "tokenmill_router:replica_health_transitions_total", replica=sick.url, to="up") == 1

    run(scenario)


def test_no_healthy_replica_is_503_and_other_routes_pass_through() -> None:
    async def scenario(rig: RouterRig) -> None:
        models = await rig.client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
        lora = await rig.client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
        assert lora.status_code == 501 and "each replica" in lora.json()["error"]["message"]
        bad = await rig.client.post("/v1/completions", content=b"{not json")
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
        for replica in rig.replicas:
            replica.healthy = False
        await wait_until(lambda: not rig.router.balancer.healthy_names())
        assert (await rig.client.get("/health")).status_code == 503
        refused = await rig.client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert refused.status_code == 503 and "unhealthy" in refused.json()["error"]["message"]

    run(scenario)


def test_a_replica_not_ready_at_start_joins_when_it_answers() -> None:
    async def scenario(rig: RouterRig) -> None:
        late = rig.replicas[1]
        assert not rig.router.balancer.is_healthy(late.url)  # one failed start-up check drops it
        assert {await post(rig, chat(f"t{i}", "x")) for i in range(3)} == {rig.replicas[0].url}
        late.healthy = True
        await wait_until(lambda: rig.router.balancer.is_healthy(late.url))

    run(scenario, unhealthy_at_start=(1,))


def test_a_client_leaving_a_stream_releases_the_replica() -> None:
    async def scenario(rig: RouterRig) -> None:
        async with rig.client.stream("POST", "/v1/chat/completions", json=chat(SYSTEM, "go", stream=True)) as response:
            owner = rig.replica(response.headers[REPLICA_HEADER])
            async for _ in response.aiter_raw():
                break  # the client goes away after the first event
        await wait_until(lambda: owner.running == 0 and rig.router.balancer.load_of(owner.url).in_flight == 0)
        assert len(owner.seen) == 1

    run(scenario, chunk_s=0.3)


def test_a_5xx_or_429_before_any_byte_is_retried_elsewhere_and_the_last_one_returned() -> None:
    async def scenario(rig: RouterRig) -> None:
        first, second = rig.replicas
        first.fail_status = 503
        for i in range(3):  # whichever replica the policy picks, the answer comes from the good one
            assert await post(rig, chat(f"p{i}", "x", stream=i % 2 == 1)) == second.url
        second.fail_status = 429
        both = await rig.client.post("/v1/chat/completions", json=chat("q", "x"))
        assert both.status_code in (429, 503) and both.json()["error"]["message"].endswith("refuses")
        text = (await rig.client.get("/metrics")).text
        assert metric(text, "tokenmill_router:retries_total", replica=first.url, reason="status_503") >= 2
        assert rig.router.balancer.healthy_names() == [first.url, second.url]  # answers are not deaths

    run(scenario, policy="round_robin")
