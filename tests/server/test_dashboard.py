"""/dashboard over the fake engine: the page and its files are served (package data), the data
endpoint's totals equal /metrics after load, the slowest requests come with their timelines, the
routes are open exactly as /metrics is (and nothing else is opened by them), bad parameters are 400s
naming the parameter, and `--cost-per-hour` / `--metrics-prefix` reach the state."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.fake_engine import MODEL, FakeEngine, fake_server_state
from tokenmill.server.api_server import create_app, is_open_path
from tokenmill.server.state import ServerState

Scenario = Callable[[httpx.AsyncClient, ServerState, FakeEngine], Awaitable[None]]


def run(scenario: Scenario, **state_kwargs) -> None:
    async def main() -> None:
        engine = FakeEngine()
        await engine.start()
        state = fake_server_state(engine, **state_kwargs)
        transport = httpx.ASGITransport(app=create_app(state))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
                await asyncio.wait_for(scenario(client, state, engine), 15)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def metrics_totals(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


async def load(client: httpx.AsyncClient, headers: dict[str, str], num: int = 12) -> None:
    async def one(i: int) -> None:
        body = {"model": MODEL, "prompt": "x" * (5 + i), "max_tokens": 3 + i % 7, "ignore_eos": True}
        r = await client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text

    await asyncio.gather(*(one(i) for i in range(num)))


def test_page_data_and_timelines_match_metrics() -> None:
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        key = {"Authorization": "Bearer k"}
        page = await client.get("/dashboard")
        assert page.status_code == 200 and "<canvas" not in page.text  # charts are built by the script
        assert 'src="dashboard/static/dashboard.js"' in page.text and f"tokenmill · {MODEL}" in page.text
        for name, kind in (("dashboard.js", "javascript"), ("dashboard.css", "css")):
            r = await client.get(f"/dashboard/static/{name}")
            assert r.status_code == 200 and kind in r.headers["content-type"] and len(r.text) > 500
        r = await client.get("/dashboard/static/evil.py")
        assert r.status_code == 404 and r.json()["error"]["param"] == "name"

        state.dashboard.sample()
        await load(client, key)
        await asyncio.sleep(0.05)
        state.dashboard.interval_s = 0.001  # the next /data call samples at once
        await asyncio.sleep(0.01)
        data = (await client.get("/dashboard/data")).json()
        totals = data["totals"]
        exported = metrics_totals((await client.get("/metrics")).text)
        assert totals["requests_finished"] == exported["tokenmill:request_success_total"] == 12
        assert totals["output_tokens"] == exported["tokenmill:generation_tokens_total"] == sum(3 + i % 7 for i in range(12))
        assert totals["prompt_tokens"] == exported["tokenmill:prompt_tokens_total"]
        # vLLM's per-request parameter histograms: 12 requests of n=1, max_tokens 3..9.
        assert exported["tokenmill:request_params_n_count"] == 12 and exported["tokenmill:request_params_n_sum"] == 12
        assert exported["tokenmill:request_params_max_tokens_sum"] == sum(3 + i % 7 for i in range(12))
        assert exported["tokenmill:request_max_num_generation_tokens_sum"] == sum(3 + i % 7 for i in range(12))
        assert data["points"], "no chart point after two samples"
        last = data["points"][-1]
        assert last["ttft_p50"] is not None and last["output_tps"] > 0
        assert data["cost_per_hour"] == 3.6 and last["cost_per_m_output"] == pytest.approx(3.6 / (last["output_tps"] * 3600) * 1e6)

        slowest = data["slowest"]
        assert len(slowest) == 12
        assert [r["e2e"] for r in slowest] == sorted((r["e2e"] for r in slowest), reverse=True)
        assert slowest[0]["output_tokens"] == 9  # the longest replies take the most steps
        detail = (await client.get(f"/dashboard/requests/{slowest[0]['id']}")).json()
        names = [p["name"] for p in detail["phases"]]
        assert names == ["to engine", "waiting", "prefill", "decode", "to client"]
        for phase in detail["phases"]:
            assert 0 <= phase["start"] <= phase["end"] <= detail["e2e"] + 1e-6
        marks = [m["name"] for m in detail["marks"]]
        assert marks[0] == "arrival" and marks[-1] == "finished" and "first token" in marks and "prefill chunk" in marks

        since = (await client.get("/dashboard/data", params={"since": last["t"]})).json()
        assert all(p["t"] > last["t"] for p in since["points"])
        by_ttft = (await client.get("/dashboard/data", params={"sort": "ttft", "slowest": 3})).json()["slowest"]
        assert len(by_ttft) == 3 and by_ttft[0]["ttft"] >= by_ttft[-1]["ttft"]

        for params, param in (({"sort": "size"}, "sort"), ({"slowest": -1}, "slowest")):
            r = await client.get("/dashboard/data", params=params)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        r = await client.get("/dashboard/requests/nope")
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]

    run(scenario, api_key="k", cost_per_hour=3.6)


def test_dashboard_is_open_as_metrics_is_and_opens_nothing_else() -> None:
    for path in ("/dashboard", "/dashboard/data", "/dashboard/static/dashboard.js", "/dashboard/requests/cmpl-1-ab"):
        assert is_open_path(path), path
    for path in ("/dashboard/../v1/models", "/dashboard/static/../../v1/models", "/dashboard/requests/..",
                 "/dashboard/x", "/dashboardx", "/dashboard/data/", "/v1/models", "/dashboard/requests/a/b"):  # fmt: skip
        assert not is_open_path(path), path

    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        assert (await client.get("/dashboard")).status_code == 200
        assert (await client.get("/dashboard/data")).status_code == 200
        assert (await client.get("/v1/models")).status_code == 401

    run(scenario, api_key="k")


def test_serve_flags_reach_the_state(tmp_path) -> None:
    from tokenmill.cli import build_parser
    from tokenmill.server.launch import build_server

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", str(tmp_path), "--metrics-prefix", "vllm", "--cost-per-hour", "2.5"])
    state = build_server(args).tm_state
    assert state.cost_per_hour == 2.5 and state.dashboard.cost_per_hour == 2.5
    assert state.metrics.prefix == "vllm:" and state.dashboard.prefix == "vllm:"
    assert b"vllm:time_to_first_token_seconds_count" in state.metrics.render()
    for bad in ("0", "-1", "nan", "cheap"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--cost-per-hour", bad])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--metrics-prefix", "sglang"])
