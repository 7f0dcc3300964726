"""tokenmill:request_rejected_total{reason}: every request refused before it reaches the engine is
counted once, under the reason it was refused for, and requests the engine had are never counted —
read through /metrics on the real HTTP stack over the scripted FakeEngine."""

from __future__ import annotations

import asyncio

from tests.reliability.fake_server import FakeServer, assert_openai_error, run
from tests.reliability.server_tools import parse_metrics
from tests.server.fake_engine import wait_until
from tokenmill.metrics import REJECTION_REASONS
from tokenmill.server.admission import AdmissionControl

COMPLETIONS = "/v1/completions"
KEY = {"Authorization": "Bearer k3y"}


async def rejected(fs: FakeServer) -> dict[str, float]:
    """reason -> count, from GET /metrics (open without the API key)."""
    response = await fs.client.get("/metrics")
    assert response.status_code == 200
    series = parse_metrics(response.text)["tokenmill:request_rejected_total"]
    return {labels["reason"]: value for labels, value in series}


def test_every_refusal_is_counted_by_reason_and_admitted_requests_are_not():
    async def scenario(fs: FakeServer) -> None:
        before = await rejected(fs)
        assert before == dict.fromkeys(REJECTION_REASONS, 0.0)  # every series exported from the start

        expected = dict.fromkeys(REJECTION_REASONS, 0)

        async def refused(status: int, reason: str, method: str, path: str, **kwargs) -> None:
            response = await fs.client.request(method, path, **kwargs)
            assert_openai_error(response, status)
            expected[reason] += 1

        await refused(401, "unauthorized", "POST", COMPLETIONS, json={"prompt": "hi"})
        await refused(401, "unauthorized", "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
        await refused(400, "invalid", "POST", COMPLETIONS, content=b"{not json", headers=KEY)
        await refused(
            400, "invalid", "POST", COMPLETIONS, json={"prompt": "hi", "temperature": -1}, headers=KEY
        )
        await refused(400, "invalid", "POST", "/tokenize", json={"prompt": 5}, headers=KEY)
        await refused(405, "invalid", "GET", COMPLETIONS, headers=KEY)
        await refused(
            404, "not_found", "POST", COMPLETIONS, json={"prompt": "hi", "model": "nope"}, headers=KEY
        )
        await refused(404, "not_found", "GET", "/v2/nothing", headers=KEY)
        await refused(413, "too_large", "POST", COMPLETIONS, content=b"x" * 5000, headers=KEY)
        await refused(431, "too_large", "GET", "/version", headers={**KEY, "x-big": "y" * 3000})

        # 429: one request waits (the engine schedules nothing), the next one does not fit.
        fs.engine.core.paused = True
        waiting = asyncio.create_task(
            fs.client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2}, headers=KEY)
        )
        await wait_until(lambda: fs.state.admission.num_waiting_seqs == 1)
        await refused(429, "queue_full", "POST", COMPLETIONS, json={"prompt": "hi"}, headers=KEY)
        fs.engine.core.paused = False
        assert (await waiting).status_code == 200  # admitted and completed: no refusal

        assert await rejected(fs) == expected
        assert len(fs.engine.core.added) == 1  # only the admitted request reached the engine

        # A request the engine had when it died gets 503, but it was not refused: not counted.
        fs.engine.core.paused = True
        in_engine = asyncio.create_task(fs.client.post(COMPLETIONS, json={"prompt": "hi"}, headers=KEY))
        await wait_until(lambda: len(fs.engine.core.added) == 2)
        fs.engine.client.mark_dead("killed by the test")
        assert_openai_error(await in_engine, 503)
        assert await rejected(fs) == expected
        # New requests to a dead engine are refused as unavailable.
        await refused(503, "unavailable", "POST", COMPLETIONS, json={"prompt": "hi"}, headers=KEY)
        await refused(503, "unavailable", "POST", "/tokenize", json={"prompt": "hi"}, headers=KEY)
        assert await rejected(fs) == expected

    run(
        scenario,
        api_key="k3y",
        max_body_bytes=4096,
        max_header_bytes=2048,
        admission=AdmissionControl(max_num_waiting_seqs=1),
    )


def test_draining_refusals_count_as_unavailable():
    async def scenario(fs: FakeServer) -> None:
        fs.state.draining = True
        for _ in range(3):
            assert_openai_error(await fs.client.post(COMPLETIONS, json={"prompt": "hi"}), 503)
        counts = await rejected(fs)
        assert counts["unavailable"] == 3
        assert sum(counts.values()) == 3

    run(scenario)
