"""The real server (default model) in a subprocess, driven with the official `openai` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from tests.server.server_process import alive as _alive
from tests.server.server_process import cmdline as _cmdline
from tests.server.server_process import start_server

MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("trace"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path, trace_dir):
    proc = start_server(
        str(tmp_path_factory.mktemp("server")), "--max-model-len", str(MAX_MODEL_LEN), "--device", "cpu",
        "--trace-dir", trace_dir,
    )  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith(f"tokenmill:{name}"):
            m = re.match(rf"tokenmill:{name}(\{{[^}}]*\}})? (\S+)", line)
            if m:
                total += float(m.group(2))
                found = True
    assert found, f"metric tokenmill:{name} not exported"
    return total


def test_models_health_version_tokenize(server, client, model_id):
    models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert models[0]["id"] == model_id and models[0]["root"] and models[0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text == "Hello world"


def test_chat_and_completions_streaming_and_not(client, model_id):
    chat = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content and chat.choices[0].finish_reason in ("stop", "length")
    assert 0 < chat.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Say hi"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == chat.choices[0].message.content
    assert finish == chat.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens

    completion = client.completions.create(model=model_id, prompt="The sky is", max_tokens=10, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_id, prompt="The sky is", max_tokens=10, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == completion.choices[0].text and completion.usage.completion_tokens == 10


def test_n_logprobs_echo_and_token_prompts(client, model_id):
    out = client.completions.create(
        model=model_id, prompt="One, two,", max_tokens=5, temperature=0, n=2, logprobs=3
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text == out.choices[1].text  # greedy: both samples agree
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    echo = client.completions.create(
        model=model_id, prompt="One, two,", max_tokens=3, temperature=0, echo=True
    )
    assert echo.choices[0].text.startswith("One, two,")
    multi = client.completions.create(
        model=model_id, prompt=[[504, 3458], [9906, 28]], max_tokens=3, temperature=0
    )
    assert sorted(c.index for c in multi.choices) == [0, 1]
    chat = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


def test_stop_strings_and_seeds(client, model_id):
    base = (
        client.completions.create(
            model=model_id, prompt="Count: one, two, three,", max_tokens=12, temperature=0
        )
        .choices[0]
        .text
    )
    stop = base[3:7]
    cut = client.completions.create(
        model=model_id, prompt="Count: one, two, three,", max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].text == base[: base.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model_id,
            prompt="Count: one, two, three,",
            max_tokens=12,
            temperature=0,
            stop=[stop],
            stream=True,
        )
        if c.choices
    )
    assert streamed == cut.choices[0].text
    a = (
        client.completions.create(model=model_id, prompt="Once", max_tokens=6, temperature=1.0, seed=7)
        .choices[0]
        .text
    )
    b = (
        client.completions.create(model=model_id, prompt="Once", max_tokens=6, temperature=1.0, seed=7)
        .choices[0]
        .text
    )
    assert a == b


def test_cached_tokens_on_repeated_long_prompt(server, client, model_id):
    hits_before = metric(server, "prefix_cache_hits_total")
    queries_before = metric(server, "prefix_cache_queries_total")
    prompt = "The history of the city is long and varied. " * 20
    first = client.completions.create(model=model_id, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=model_id, prompt=prompt, max_tokens=2, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert cached >= first.usage.prompt_tokens - 16
    # /metrics saw the same: both prompts looked up, the second one's hit counted.
    assert metric(server, "prefix_cache_queries_total") - queries_before >= 2 * first.usage.prompt_tokens
    assert metric(server, "prefix_cache_hits_total") - hits_before >= cached


# Every series issue 3 names, as the real server exports them (vLLM's names, `tokenmill:` prefix).
ISSUE_3_METRICS = [
    'request_success_total{finished_reason="stop"',
    'request_success_total{finished_reason="length"',
    'request_success_total{finished_reason="abort"',
    "prompt_tokens_total",
    "generation_tokens_total",
    "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket",
    "request_queue_time_seconds_bucket",
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "num_preemptions_total",
]


def test_metrics_export_every_series_and_count_requests(server, client, model_id):
    before = metric(server, "generation_tokens_total"), metric(server, "time_to_first_token_seconds_count")
    out = client.completions.create(model=model_id, prompt="Metrics", max_tokens=5, temperature=0)
    text = httpx.get(f"{server.base_url}/metrics").text
    missing = [name for name in ISSUE_3_METRICS if f"\ntokenmill:{name}" not in text]
    assert not missing, f"not exported: {missing}"
    assert metric(server, "generation_tokens_total") - before[0] == out.usage.completion_tokens
    assert metric(server, "time_to_first_token_seconds_count") - before[1] == 1
    assert metric(server, "request_queue_time_seconds_count") >= 1
    assert metric(server, "e2e_request_latency_seconds_count") >= 1


def test_dashboard_shows_the_real_engines_timelines_and_metrics(server, client, model_id):
    """The real engine's RequestTimeline reaches the dashboard's recent requests (through the core
    process's socket), and the engine-side metrics (tokens per step, cache config) are exported."""
    out = client.completions.create(model=model_id, prompt="Dashboard timelines " * 5, max_tokens=6, temperature=0)
    data = httpx.get(f"{server.base_url}/dashboard/data", params={"slowest": 1000}).json()
    mine = [r for r in data["slowest"] if r["id"].startswith(out.id)]
    assert len(mine) == 1, [r["id"] for r in data["slowest"]]
    assert mine[0]["output_tokens"] == out.usage.completion_tokens
    assert mine[0]["prompt_tokens"] == out.usage.prompt_tokens
    detail = httpx.get(f"{server.base_url}/dashboard/requests/{mine[0]['id']}").json()
    assert [p["name"] for p in detail["phases"]] == ["to engine", "waiting", "prefill", "decode", "to client"]
    assert sum(int(m["note"].split()[0]) for m in detail["marks"] if m["name"] == "prefill chunk") <= out.usage.prompt_tokens
    assert data["totals"]["requests_finished"] >= 1
    assert metric(server, "iteration_tokens_total_count") >= 1
    assert metric(server, "cache_config_info") == 1
    assert metric(server, "request_prefill_time_seconds_count") >= 1


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "prompt": "hi"}, 404, "model"),
        ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"prompt": "hi", "top_p": 2}, 400, "top_p"),
        ({"prompt": "hi", "max_tokens": 5000}, 400, "max_tokens"),
        ({"prompt": "hi " * 1500, "max_tokens": 4}, 400, "prompt"),
        ({"prompt": "hi", "n": 1000}, 400, "n"),
        ({"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
        ({"prompt": [10**9]}, 400, "prompt"),
    ],
)
def test_error_statuses(server, body, status, param):
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] and error["param"] == param and error["code"] == status


def test_malformed_json_and_unknown_route(server):
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400
    r = httpx.post(
        f"{server.base_url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]}
    )
    assert r.status_code == 400
    assert httpx.get(f"{server.base_url}/v1/nothing").status_code == 404
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_32_concurrent_streams_match_offline_greedy(server, model_id):
    import torch

    from tokenmill import LLM, SamplingParams

    prompts = [f"Write one sentence about the number {i}." for i in range(32)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=model_id, prompt=prompt, max_tokens=8, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=300
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(run_all())
    # The server's engine runs one torch thread fewer than the cores (core_process._init_torch);
    # the offline engine here does the same, so the matmuls reduce in the same order.
    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))
    try:
        offline = LLM(None, device="cpu", max_model_len=MAX_MODEL_LEN).generate(
            prompts, SamplingParams(temperature=0, max_tokens=8)
        )
    finally:
        torch.set_num_threads(threads)
    assert texts == [o.outputs[0].text for o in offline]


def _wait_idle(server, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (
            metric(server, "num_requests_running") == 0
            and metric(server, "num_requests_waiting") == 0
            and metric(server, "kv_cache_usage_perc") == 0
        ):
            return
        time.sleep(0.1)
    raise AssertionError("requests still running or KV blocks still held after the clients left")


def test_disconnects_free_everything(server, model_id):
    # Streaming: read two chunks, then drop the connection.
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions",
        json={"model": model_id, "prompt": "Tell a long story", "max_tokens": 500, "ignore_eos": True, "stream": True},
        timeout=60,
    ) as response:  # fmt: skip
        lines = response.iter_lines()
        next(lines)
        next(lines)
    # Non-streaming: give up before the answer comes.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": model_id, "prompt": "Another long story", "max_tokens": 500, "ignore_eos": True},
            timeout=1.0,
        )
    _wait_idle(server)
    text = httpx.get(f"{server.base_url}/metrics").text
    aborted = re.search(r'tokenmill:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', text)
    assert aborted and float(aborted.group(1)) >= 2


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def test_structured_outputs_and_forced_tool_calls_on_the_real_model(server, client, model_id):
    """The grammar holds on the real model at temperature 1 (constraint enforcement end to end);
    bad constraints are 400s; nothing is left running or holding KV blocks afterwards."""
    import json

    import jsonschema

    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    reply = client.chat.completions.create(
        model=model_id, messages=messages, temperature=1.0, n=4, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        extra_body={"seed": 3},
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    choice = client.chat.completions.create(
        model=model_id, messages=messages, temperature=1.0, max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    ).choices[0]  # fmt: skip
    assert choice.message.content in ("yes", "no")
    ask = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    # parallel_tool_calls=False: one call, so max_tokens cannot cut a tiny model's list of calls short
    # (a cut list keeps its complete calls, with finish_reason "length").
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = client.chat.completions.create(
            model=model_id, messages=ask, tools=[WEATHER_TOOL], tool_choice=tool_choice, temperature=1.0,
            max_tokens=120, parallel_tool_calls=False,
        )  # fmt: skip
        calls = whole.choices[0].message.tool_calls
        assert calls and whole.choices[0].finish_reason == "tool_calls", whole.choices[0]
        for call in calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])
        names, arguments = {}, {}
        for chunk in client.chat.completions.create(
            model=model_id, messages=ask, tools=[WEATHER_TOOL], tool_choice=tool_choice, temperature=1.0,
            max_tokens=120, stream=True, parallel_tool_calls=False,
        ):  # fmt: skip
            for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if call.function.name:
                    names[call.index] = call.function.name
                arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
        assert names and set(names.values()) == {"get_weather"}
        for text in arguments.values():
            jsonschema.validate(json.loads(text), WEATHER_TOOL["function"]["parameters"])
    for bad in ({"guided_regex": "(unclosed"}, {"guided_grammar": "root ::= nothing_defined"}):
        for stream in (False, True):
            r = httpx.post(
                f"{server.base_url}/v1/chat/completions",
                json={"model": model_id, "messages": messages, "max_tokens": 5, "stream": stream, **bad},
                timeout=60,
            )
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == next(iter(bad)), r.text
    _wait_idle(server)


def test_bench_serve_splits_the_slowest_requests_time_from_the_servers_trace(server, trace_dir, tmp_path):
    """A real `bench serve` run against the traced server: every request is found in the trace, and
    its TTFT stages (client, API server, engine) add up to the TTFT the client measured."""
    import argparse

    from tokenmill.bench import serve as bench_serve

    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    args = parser.parse_args([
        "--base-url", server.base_url, "--num-prompts", "12", "--random-input-len", "24",
        "--random-output-len", "4", "--request-rate", "8", "--ignore-eos", "--disable-tqdm",
        "--server-trace-dir", trace_dir, "--save-result", "--result-dir", str(tmp_path),
    ])  # fmt: skip
    (run,) = asyncio.run(bench_serve.run_benchmark(args))
    tail = run.metrics["tail"]
    assert run.metrics["completed"] == 12
    assert tail["requests_traced"] == 12 and tail["requests_untraced"] == 0, tail
    (worst,) = tail["slowest_ttft"]
    assert abs(sum(worst["stages_ms"].values()) - worst["ttft_ms"]) < 0.5
    assert all(v >= 0 for v in worst["stages_ms"].values()), worst
    assert worst["while_waiting"]["steps"] >= 1
    assert tail["steps"]["num_steps"] >= 12 and tail["steps"]["jit_compiles"] == 0
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["metrics"]["tail"]["requests_traced"] == 12


def test_engine_death_fails_requests_fast(server, model_id):
    """Runs last on the shared server: it kills that server's engine."""
    engine = [pid for pid in server.child_pids() if _is_engine(_cmdline(pid))]
    assert len(engine) == 1
    results: dict[str, object] = {}

    def stream() -> None:
        with httpx.stream(
            "POST", f"{server.base_url}/v1/completions",
            json={"model": model_id, "prompt": "Go", "max_tokens": 400, "ignore_eos": True, "stream": True},
            timeout=30,
        ) as response:  # fmt: skip
            results["events"] = [line for line in response.iter_lines() if line]

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 30
    while metric(server, "num_requests_running") < 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    os.kill(engine[0], signal.SIGKILL)
    killed = time.monotonic()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - killed < 5, "the stream hung after the engine died"
    events = results["events"]
    assert events[-1] == "data: [DONE]" and '"code":503' in events[-2]  # type: ignore[index]
    assert httpx.get(f"{server.base_url}/health").status_code == 503
    started = time.monotonic()
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert r.status_code == 503 and time.monotonic() - started < 2


def test_sigterm_drains_then_aborts_and_reaps_the_engine(tmp_path, default_model_path):
    proc = start_server(str(tmp_path), "--max-model-len", "2048", "--device", "cpu", "--shutdown-timeout", "6")
    engine_pids = proc.child_pids()
    engine_cmdlines = {pid: _cmdline(pid) for pid in engine_pids}
    results: dict[str, object] = {}

    def complete(name: str, max_tokens: int) -> None:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="x", max_retries=0, timeout=120)
        results[name] = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )

    threads = [
        # 24 tokens: long enough (~1 s here) that both are seen running at once; with 4 the
        # short one could finish between two polls of the metric (seen once in CI).
        threading.Thread(target=complete, args=("short", 24)),
        # 1,500 tokens outlast the 6 s drain on any CPU seen so far: 400 did once the quantized
        # GEMV made two streams decode at ~70 tok/s each (the drain then ended it as "length").
        threading.Thread(target=complete, args=("long", 1500)),
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while metric(proc, "num_requests_running") < 2:  # both in flight before the signal
        assert time.monotonic() < deadline, "the requests never started running"
        time.sleep(0.05)
    started = time.monotonic()
    proc.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    if proc.process.poll() is None:
        with contextlib.suppress(httpx.TransportError):  # already gone is fine too
            assert httpx.get(f"{proc.base_url}/health", timeout=5).status_code == 503
            r = httpx.post(f"{proc.base_url}/v1/completions", json={"prompt": "late"}, timeout=5)
            assert r.status_code == 503
    for thread in threads:
        thread.join(60)
    assert proc.process.wait(60) == 0, proc.log()
    assert time.monotonic() - started < 6 + 15, "the drain outlived --shutdown-timeout by far"
    short, long = results["short"], results["long"]
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 24  # type: ignore[attr-defined]
    assert long.choices[0].finish_reason == "abort"  # type: ignore[attr-defined]
    engine = [pid for pid, cmd in engine_cmdlines.items() if _is_engine(cmd)]
    assert len(engine) == 1 and not _alive(engine[0]), "the engine process outlived the server"
    # The engine is reaped before the server exits; multiprocessing's resource tracker leaves
    # on its own once its pipe closes. Give that a moment, then nothing may be left.
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in engine_pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in engine_pids:
        assert not _alive(pid), f"process {pid} (engine or its helper) outlived the server"


def _is_engine(cmdline: str) -> bool:
    return "tokenmill.engine.core_process" in cmdline or "multiprocessing.spawn" in cmdline


@pytest.mark.skipif("OMP_NUM_THREADS" in os.environ, reason="the thread count is the user's then")
def test_a_cpu_engine_on_device_auto_leaves_one_core_to_the_api_server(tmp_path, default_model_path):
    # `serve` leaves device "auto" to the engine process (the API server has no torch): the engine
    # must resolve it before choosing its thread count, as it did when the API server resolved it.
    proc = start_server(str(tmp_path), "--max-model-len", "256")
    try:
        cores = len(os.sched_getaffinity(0))
        expected = f"engine on CPU: {max(1, cores - 1)} torch threads of {cores} cores"
        assert expected in proc.log(), proc.log()
    finally:
        proc.stop()

