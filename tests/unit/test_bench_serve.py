"""`bench serve` against a fake OpenAI-compatible streaming server, plus its pieces in isolation."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

from tests.unit.threaded_http_server import ThreadedHTTPServer
from tokenmill.bench import serve
from tokenmill.bench.datasets import length_range, prefix_repetition_requests, random_requests
from tokenmill.bench.results import write_result
from tokenmill.bench.serve_metrics import RequestResult, compute_metrics, parse_goodput

TOKEN_DELAY_S = 0.004


class FakeOpenAIServer(ThreadedHTTPServer):
    """Streams `min(max_tokens, num_tokens)` one-word chunks with a small sleep before each."""

    def __init__(self, num_tokens: int = 6, fail_every: int = 0, drop_done: bool = False) -> None:
        self.num_tokens = num_tokens
        self.fail_every = fail_every
        self.drop_done = drop_done
        self.payloads: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        super().__init__()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "root": "fake-model"}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        words = (await request.json())["prompt"].split()
        return web.json_response({"tokens": [100 + i for i in range(len(words))]})

    async def _detokenize(self, request: web.Request) -> web.Response:
        tokens = (await request.json())["tokens"]
        return web.json_response({"prompt": " ".join(f"t{t}" for t in tokens)})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        if self.fail_every and len(self.payloads) % self.fail_every == 0:
            error = {"error": {"message": "boom", "type": "internal_error", "param": None, "code": 500}}
            return web.json_response(error, status=500)
        chat = "messages" in payload
        max_tokens = payload["max_completion_tokens" if chat else "max_tokens"]
        prompt = payload["messages"][0]["content"] if chat else payload["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        n = min(max_tokens, self.num_tokens)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            if chat:  # like real servers: a role-only first chunk, which carries no token
                await resp.write(self._event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
            for i in range(n):
                await asyncio.sleep(TOKEN_DELAY_S)
                piece = f" w{i}"
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                await resp.write(self._event({"choices": [choice]}))
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n,
                "total_tokens": prompt_tokens + n,
            }
            await resp.write(self._event({"choices": [], "usage": usage}))
            if not self.drop_done:
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer(**getattr(request, "param", {}))
    server.start()
    yield server
    server.stop()


def parse_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    return parser.parse_args(list(argv))


def common_args(server: FakeOpenAIServer, tmp_path: Path, *extra: str) -> argparse.Namespace:
    return parse_args(
        "--base-url", server.base_url, "--num-prompts", "8", "--random-input-len", "20",
        "--random-output-len", "5", "--disable-tqdm", "--result-dir", str(tmp_path), *extra,
    )  # fmt: skip


def load_results(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]


def test_completions_run_reports_and_saves(fake_server: FakeOpenAIServer, tmp_path: Path) -> None:
    args = common_args(
        fake_server, tmp_path, "--max-concurrency", "2", "--ignore-eos", "--save-result",
        "--result-filename", "run", "--goodput", "ttft:10000 tpot:10000", "--metric-percentiles", "90,99",
    )  # fmt: skip
    assert serve.main(args) == 0

    [record] = load_results(tmp_path)
    assert {"benchmark", "device", "command", "commit", "timestamp", "config", "metrics"} <= record.keys()
    assert record["benchmark"] == "serve"
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?|unknown", record["commit"])
    assert record["config"]["request_rate"] == "inf"
    assert record["config"]["model"] == "fake-model"
    assert record["config"]["max_concurrency"] == 2
    m = record["metrics"]
    assert (m["completed"], m["failed"]) == (8, 0)
    assert m["total_input_tokens"] == 8 * 20
    assert m["total_output_tokens"] == 8 * 5
    assert 0 < m["mean_ttft_ms"] < m["mean_e2el_ms"]
    assert m["median_itl_ms"] >= TOKEN_DELAY_S * 1000 * 0.9
    assert m["p90_itl_ms"] <= m["p99_itl_ms"]
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])  # every request met loose SLOs
    assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration"])

    # Prompts went out as exact-length token-id lists, with the extras asked for.
    assert len(fake_server.payloads) == 8
    for payload in fake_server.payloads:
        assert isinstance(payload["prompt"], list) and len(payload["prompt"]) == 20
        assert payload["max_tokens"] == 5 and payload["ignore_eos"] is True and payload["stream"] is True
    assert fake_server.max_in_flight <= 2


@pytest.mark.parametrize("fake_server", [{"fail_every": 4}], indirect=True)
def test_failed_requests_are_counted(fake_server: FakeOpenAIServer, tmp_path: Path) -> None:
    args = common_args(
        fake_server, tmp_path, "--max-concurrency", "3", "--save-result", "--goodput", "ttft:1e-6"
    )
    assert serve.main(args) == 0
    m = load_results(tmp_path)[0]["metrics"]
    assert (m["completed"], m["failed"]) == (6, 2)
    assert m["total_output_tokens"] == 6 * 5
    assert m["request_goodput"] == 0.0  # nobody gets a first token within a nanosecond


@pytest.mark.parametrize("fake_server", [{"drop_done": True}], indirect=True)
def test_stream_without_done_is_a_failure(fake_server: FakeOpenAIServer, tmp_path: Path) -> None:
    args = common_args(fake_server, tmp_path, "--save-result")
    assert serve.main(args) == 1  # every request failed
    assert load_results(tmp_path)[0]["metrics"]["failed"] == 8


def test_chat_sweep_writes_one_result_per_concurrency_and_a_plot(
    fake_server: FakeOpenAIServer, tmp_path: Path
) -> None:
    plot = tmp_path / "sweep.png"
    args = common_args(
        fake_server, tmp_path, "--endpoint", "/v1/chat/completions", "--max-concurrency", "1,4",
        "--num-warmups", "2", "--save-result", "--result-filename", "sweep", "--plot", str(plot),
    )  # fmt: skip
    assert serve.main(args) == 0
    records = load_results(tmp_path)
    assert sorted(r["config"]["max_concurrency"] for r in records) == [1, 4]
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["sweep-c1.json", "sweep-c4.json"]
    for r in records:
        assert (r["metrics"]["completed"], r["metrics"]["total_output_tokens"]) == (8, 40)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # 2 warm-ups + 2 runs of 8; chat prompts are decoded text, not token ids.
    assert len(fake_server.payloads) == 18
    content = fake_server.payloads[-1]["messages"][0]["content"]
    assert isinstance(content, str) and len(content.split()) == 20
    assert fake_server.payloads[-1]["max_completion_tokens"] == 5


def test_unreachable_server_fails_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args("--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--disable-tqdm")
    assert serve.main(args) == 1
    assert "bench serve: error" in capsys.readouterr().err


def test_compute_metrics_exact_values() -> None:
    a = RequestResult(success=True, prompt_len=10, output_tokens=3, ttft=0.1, itl=[0.05, 0.05], latency=0.2)
    b = RequestResult(success=True, prompt_len=20, output_tokens=5, ttft=0.3, itl=[0.1] * 4, latency=0.7)
    failed = RequestResult(error="HTTP 500")
    m = compute_metrics([a, b, failed], duration=2.0, goodput_slos={"ttft": 200.0})
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 8)
    assert m["request_throughput"] == 1.0
    assert m["output_throughput"] == 4.0
    assert m["total_token_throughput"] == 19.0
    assert m["request_goodput"] == 0.5  # only `a` has TTFT <= 200 ms
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_e2el_ms"] == pytest.approx(450.0)
    assert m["mean_tpot_ms"] == pytest.approx((50.0 + 100.0) / 2)  # (e2el - ttft) / (tokens - 1)
    assert m["mean_itl_ms"] == pytest.approx((0.05 * 2 + 0.1 * 4) / 6 * 1000)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    assert compute_metrics([a], 1.0)["request_goodput"] is None


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500 tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_random_dataset_lengths_and_tokens() -> None:
    pool = list(range(1000, 1300))
    assert length_range(100, 0.5) == (50, 150)
    reqs = random_requests(pool, 200, 100, 10, 0.5, np.random.default_rng(0))
    assert all(50 <= r.prompt_len <= 150 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 20  # the range is actually used
    assert all(set(r.prompt) <= set(pool) for r in reqs)
    fixed = random_requests(pool, 5, 16, 4, 0.0, np.random.default_rng(0))
    assert {(r.prompt_len, r.expected_output_len) for r in fixed} == {(16, 4)}
    with pytest.raises(ValueError, match="range-ratio"):
        length_range(10, 1.0)


def test_prefix_repetition_dataset_shares_prefixes() -> None:
    reqs = prefix_repetition_requests(list(range(500)), 12, 32, 8, 3, 7, np.random.default_rng(1))
    assert len(reqs) == 12
    assert all(r.prompt_len == 40 and r.expected_output_len == 7 for r in reqs)
    prefixes = [tuple(r.prompt[:32]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({tuple(r.prompt) for r in reqs}) == 12  # suffixes make every prompt unique


def test_arrivals_and_concurrency_parsing() -> None:
    assert not serve.arrival_offsets(5, float("inf"), 1.0, np.random.default_rng(0)).any()
    offsets = serve.arrival_offsets(20000, 10.0, 1.0, np.random.default_rng(0))
    assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0)
    assert np.diff(offsets).mean() == pytest.approx(0.1, rel=0.05)
    bursty = np.diff(serve.arrival_offsets(20000, 10.0, 0.25, np.random.default_rng(0)))
    assert bursty.mean() == pytest.approx(0.1, rel=0.1) and bursty.std() > 1.5 * np.diff(offsets).std()
    assert serve.parse_concurrencies(None) == [None]
    assert serve.parse_concurrencies("1, 8,32") == [1, 8, 32]
    for bad in ("0", "a,b"):
        with pytest.raises(ValueError, match="--max-concurrency"):
            serve.parse_concurrencies(bad)


def test_write_result_names_and_values(tmp_path: Path) -> None:
    path = write_result(
        "throughput", {"rate": float("inf"), "x": np.int64(3)}, {"nan": float("nan")}, tmp_path
    )
    assert path.parent == tmp_path and path.name.startswith("throughput-") and path.suffix == ".json"
    record = json.loads(path.read_text())
    assert record["config"] == {"rate": "inf", "x": 3}
    assert record["metrics"] == {"nan": None}
    assert record["command"] and record["device"] and record["timestamp"]
    named = write_result("serve", {}, {}, tmp_path / "sub", name="my run")
    assert named == tmp_path / "sub" / "my_run.json"
