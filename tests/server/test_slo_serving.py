"""The `slo` scheduling policy end to end: greedy output unchanged when nothing is shed; a shed
request is a 429 with Retry-After over HTTP, holds no KV block and disturbs no other request; bad
SLO fields are 400s naming the field."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.server.fake_engine import MODEL, FakeEngine
from tests.server.server_process import start_server
from tests.server.test_api_inprocess import run
from tokenmill.server.state import ServerState

PROMPTS = ["The quick brown fox", "Hello there, how", "1 2 3 4", "def main():"]


def test_greedy_output_is_unchanged_under_slo_when_nothing_is_shed(tiny_llama_dir):
    from tokenmill import LLM
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for policy, extra in [("fcfs", {}), ("slo", {"slo_ttft_ms": 600_000.0, "slo_tpot_ms": 600_000.0})]:
        llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, max_num_seqs=2, scheduling_policy=policy, **extra)
        results[policy] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert llm.engine.get_stats().get("slo_shed_requests.default", 0) == 0
        del llm
    assert results["slo"] == results["fcfs"]
    assert all(len(ids) == 24 for ids in results["slo"])


@pytest.fixture(scope="module")
def slo_server(tmp_path_factory, paced_llama_dir):
    proc = start_server(
        str(tmp_path_factory.mktemp("slo-server")), str(paced_llama_dir), "--device", "cpu",
        "--max-model-len", "512", "--scheduling-policy", "slo", "--slo-class", "0=600000/", "--enable-debug-endpoints",
    )  # fmt: skip
    yield proc
    proc.stop()


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"tokenmill:{name}") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample tokenmill:{name} {labels} in /metrics")


def test_a_shed_request_is_a_429_with_retry_after_and_leaks_nothing(slo_server):
    base = slo_server.base_url
    victim_body = {"prompt": "Once upon a time", "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=120) as client:
        # Enough steps for the cost model to predict (it sheds nothing before), and the victim's
        # tokens when it runs alone.
        alone = client.post("/v1/completions", json=victim_body)
        assert alone.status_code == 200, alone.text
        alone_text = alone.json()["choices"][0]["text"]

        started = threading.Event()
        streamed: list[str] = []

        def stream_victim() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", json=victim_body | {"stream": True}, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        streamed.append(line)
                        started.set()

        thread = threading.Thread(target=stream_victim)
        thread.start()
        assert started.wait(60), "the victim never started streaming"
        # A 1 µs time-to-first-token target cannot be met: shed before it starts, both ways.
        hopeless = {"prompt": "a b c d e f", "max_tokens": 20, "slo_ttft_ms": 0.001}
        shed = client.post("/v1/completions", json=hopeless)
        shed_stream = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "slo_ttft_ms": 0.001, "stream": True,
        })  # fmt: skip
        thread.join(120)
        assert not thread.is_alive()

        for response in (shed, shed_stream):
            assert response.status_code == 429, response.text
            assert int(response.headers["Retry-After"]) >= 1
            error = response.json()["error"]
            assert error["type"] == "rate_limit_exceeded" and "shed by the SLO scheduler" in error["message"]
        # The victim ran beside it undisturbed: the same greedy text as alone.
        text = "".join(json.loads(line[len("data: ") :])["choices"][0]["text"] for line in streamed if '"choices":[{' in line)
        assert text == alone_text

        invariants = client.get("/debug/invariants")
        assert invariants.status_code == 200 and invariants.json()["ok"] is True, invariants.text
        stats = invariants.json()["stats"]
        assert stats["kv_cache_usage"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["slo_shed_requests.0"] == 2  # priority 0 picked the class
        metrics = client.get("/metrics").text
        assert _metric(metrics, "slo_shed_requests_total", slo_class="0") == 2
        assert _metric(metrics, "request_success_total", finished_reason="shed") == 2
        assert _metric(metrics, "request_rejected_total", reason="queue_full") == 0  # admitted, not refused
        assert _metric(metrics, "goodput_requests_total") >= 2  # the victim both times (600 s targets)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"slo_ttft_ms": -5}, "slo_ttft_ms"),
        ({"slo_ttft_ms": 0}, "slo_ttft_ms"),
        ({"slo_tpot_ms": "fast"}, "slo_tpot_ms"),
        ({"slo_tpot_ms": 1e12}, "slo_tpot_ms"),
    ],
)
def test_bad_slo_fields_are_400s_naming_the_field(fields, param):
    async def scenario(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        for path, body in [
            ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
        ]:
            r = await client.post(path, json=body | fields)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param, r.json()

    run(scenario, scheduling_policy="slo")


def test_slo_fields_under_another_policy_are_refused_and_priority_is_allowed_under_slo():
    async def fcfs(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "slo_tpot_ms": 50})
        assert r.status_code == 400 and r.json()["error"]["param"] == "slo_tpot_ms", r.text
        assert "--scheduling-policy slo" in r.json()["error"]["message"]

    async def slo(client: httpx.AsyncClient, state: ServerState, engine: FakeEngine) -> None:
        r = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, "priority": 1, "slo_ttft_ms": 500}
        )
        assert r.status_code == 200, r.text

    run(fcfs)
    run(slo, scheduling_policy="slo")
