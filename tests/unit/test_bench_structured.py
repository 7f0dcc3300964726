"""`bench serve --dataset-name json-schema` against a fake server, its pieces, and the shipped schemas."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest
from aiohttp import web

from tests.unit.threaded_http_server import ThreadedHTTPServer
from tokenmill.bench import serve
from tokenmill.bench.json_schemas import SCHEMAS
from tokenmill.bench.prometheus_text import histogram_delta, parse_samples
from tokenmill.bench.structured import (
    COMPILE_METRIC,
    MASK_METRIC,
    check_output,
    constraint_body,
    fit_to_length,
    structured_requests,
)

EXAMPLES = {json.dumps(c.schema, sort_keys=True): c.example for c in SCHEMAS}


class FakeStructuredServer(ThreadedHTTPServer):
    """Plain requests get words; constrained ones get their schema's example (valid) on the first
    constrained request and an object missing every property (invalid) after. /metrics exports the
    two grammar histograms, grown by each constrained request, when `with_metrics`."""

    def __init__(
        self, with_metrics: bool = True, reject_constrained: bool = False, plain_tokens_per_piece: int = 1
    ) -> None:
        self.with_metrics = with_metrics
        self.reject_constrained = reject_constrained
        self.plain_tokens_per_piece = plain_tokens_per_piece  # >1: plain tokens that add no text alone
        self.payloads: list[dict[str, Any]] = []
        self.constrained_seen = 0
        super().__init__()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        words = (await request.json())["prompt"].split()
        return web.json_response({"tokens": [100 + i for i in range(len(words))]})

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self.with_metrics:
            return web.Response(status=404)
        n = self.constrained_seen
        lines = []
        # compile: one 0.02 s observation per constrained request; mask: ten 0.0005 s per request.
        for name, per_request, value, le in (
            (COMPILE_METRIC, 1, 0.02, "0.025"),
            (MASK_METRIC, 10, 0.0005, "0.001"),
        ):
            count = n * per_request
            lines += [
                f"# TYPE {name} histogram",
                f'{name}_bucket{{le="{le}",model_name="fake-model"}} {count}',
                f'{name}_bucket{{le="+Inf",model_name="fake-model"}} {count}',
                f'{name}_sum{{model_name="fake-model"}} {count * value}',
                f'{name}_count{{model_name="fake-model"}} {count}',
            ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        self.payloads.append(payload)
        constraint = payload.get("structured_outputs") or payload.get("response_format")
        piece_chars, tokens = 4, None  # None: a token per piece
        if constraint is None:
            # A plain reply: 3 pieces, or exactly the limit when told to ignore EOS.
            limit = payload.get("max_tokens") or payload.get("max_completion_tokens")
            text = "".join(f" w{i:02d}" for i in range(limit)) if payload.get("ignore_eos") else " w0 w1 w2 w3"
            if payload.get("ignore_eos"):
                piece_chars, tokens = 4 * self.plain_tokens_per_piece, limit
        elif self.reject_constrained:  # a server without structured output refusing the field
            return web.json_response({"error": {"message": "json_schema is not supported"}}, status=400)
        else:
            schema = constraint.get("json") or constraint["json_schema"]["schema"]
            self.constrained_seen += 1
            text = (
                json.dumps(EXAMPLES[json.dumps(schema, sort_keys=True)])
                if self.constrained_seen == 1
                else "{}"
            )
        pieces = [text[i : i + piece_chars] for i in range(0, len(text), piece_chars)]
        tokens = len(pieces) if tokens is None else tokens
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = "messages" in payload
        for i, piece in enumerate(pieces):
            await asyncio.sleep(0.002)
            content = {"delta": {"content": piece}} if chat else {"text": piece}
            finish = "stop" if i == len(pieces) - 1 else None
            await resp.write(self._event({"choices": [{"index": 0, **content, "finish_reason": finish}]}))
        usage = {"prompt_tokens": 30, "completion_tokens": tokens, "total_tokens": 30 + tokens}
        await resp.write(self._event({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeStructuredServer]:
    server = FakeStructuredServer(**getattr(request, "param", {}))
    server.start()
    yield server
    server.stop()


def run_bench(
    server: FakeStructuredServer, tmp_path: Path, *extra: str, exit_code: int = 0
) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args([
        "--base-url", server.base_url, "--dataset-name", "json-schema", "--num-prompts", "2",
        "--max-concurrency", "1", "--structured-output-len", "300", "--disable-tqdm", "--save-result",
        "--result-dir", str(tmp_path), "--result-filename", "so", *extra,
    ])  # fmt: skip
    assert serve.main(args) == exit_code
    return json.loads((tmp_path / "so.json").read_text())


def test_one_valid_and_one_invalid_reply_is_half_valid(
    fake_server: FakeStructuredServer, tmp_path: Path
) -> None:
    record = run_bench(fake_server, tmp_path)
    assert record["benchmark"] == "serve" and record["config"]["dataset_name"] == "json-schema"
    assert {"device", "command", "commit", "config", "metrics"} <= record.keys()
    m = record["metrics"]
    assert m["max_concurrency"] == 1
    for phase in ("unconstrained", "constrained"):
        p = m[phase]
        assert (p["completed"], p["failed"]) == (2, 0)
        for key in (
            "output_throughput",
            "median_tpot_ms",
            "p50_tpot_ms",
            "p99_tpot_ms",
            "median_ttft_ms",
            "p99_ttft_ms",
        ):
            assert p[key] > 0, (phase, key)
    # Each plain request generated exactly as many tokens as its prompt's constrained reply.
    assert m["unconstrained"]["total_output_tokens"] == m["constrained"]["total_output_tokens"]
    con = m["constrained"]
    assert (con["schema_valid"], con["schema_invalid"]) == (1, 1)
    assert con["schema_valid_rate"] == m["schema_valid_rate"] == 0.5
    assert con["finish_reasons"] == {"stop": 2}
    assert con["max_output_tokens"] > 1  # the example object, in 4-character pieces
    assert list(con["invalid_reasons"]) == ["schema: required at /"]
    assert m["tpot_ratio_p50"] == pytest.approx(con["median_tpot_ms"] / m["unconstrained"]["median_tpot_ms"])
    assert m["tpot_ratio_p99"] > 0 and m["output_throughput_ratio"] > 0
    # Grammar times: what the histograms gained during the constrained phase only (2 requests).
    compile_ = con["grammar_compile"]
    assert compile_["count"] == 2 and compile_["mean_s"] == pytest.approx(0.02)
    assert 0 < compile_["p50_s"] <= compile_["p99_s"] <= 0.025
    assert con["grammar_mask_per_step"]["count"] == 20
    assert con["grammar_mask_per_step"]["mean_s"] == pytest.approx(0.0005)
    assert con["server_metrics_note"] is None

    # The same prompts went out for one token (priming the prefix cache), constrained with
    # disable_any_whitespace, then plain with the constrained replies' lengths.
    prime, constrained, plain = fake_server.payloads[:2], fake_server.payloads[2:4], fake_server.payloads[4:]
    assert [p["max_tokens"] for p in prime] == [1, 1]
    assert [p["prompt"] for p in prime] == [p["prompt"] for p in plain] == [p["prompt"] for p in constrained]
    assert all("structured_outputs" not in p and p["ignore_eos"] for p in plain)
    assert sorted(p["max_tokens"] for p in plain) == sorted([1, con["max_output_tokens"]])
    for p in constrained:
        assert p["structured_outputs"]["disable_any_whitespace"] is True and p["max_tokens"] == 300
        jsonschema.validate(
            EXAMPLES[json.dumps(p["structured_outputs"]["json"], sort_keys=True)],
            p["structured_outputs"]["json"],
        )
        assert isinstance(p["prompt"], str) and "JSON Schema" in p["prompt"]


@pytest.mark.parametrize("fake_server", [{"plain_tokens_per_piece": 2}], indirect=True)
def test_each_phase_reports_its_tokens_per_text_chunk(
    fake_server: FakeStructuredServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plain phase's replies carry two tokens a chunk here (as on the H200, where many plain
    tokens add no text): same tokens, half the chunks, which each phase's result says."""
    m = run_bench(fake_server, tmp_path)["metrics"]
    longest = m["constrained"]["max_output_tokens"]  # the other reply is "{}": one piece, one token
    assert m["constrained"]["tokens_per_text_chunk"] == 1.0
    assert m["unconstrained"]["total_output_tokens"] == m["constrained"]["total_output_tokens"] == 1 + longest
    chunks = 1 + (longest + 1) // 2  # the long reply in pieces of two tokens
    assert m["unconstrained"]["tokens_per_text_chunk"] == pytest.approx((1 + longest) / chunks)
    assert m["unconstrained"]["tokens_per_text_chunk"] > 1.5
    assert "Tokens per text chunk" in capsys.readouterr().out


@pytest.mark.parametrize("fake_server", [{"with_metrics": False}], indirect=True)
def test_response_format_token_id_prompts_and_no_metrics(
    fake_server: FakeStructuredServer, tmp_path: Path
) -> None:
    record = run_bench(
        fake_server, tmp_path, "--structured-output-field", "response_format", "--structured-input-len", "64"
    )
    con = record["metrics"]["constrained"]
    assert con["schema_valid_rate"] == 0.5
    assert con["grammar_compile"] is None and con["grammar_mask_per_step"] is None
    assert "could not be read" in con["server_metrics_note"]
    assert record["config"]["structured_output_field"] == "response_format"
    for p in fake_server.payloads:
        assert isinstance(p["prompt"], list) and len(p["prompt"]) == 64
    for p in fake_server.payloads[2:4]:
        spec = p["response_format"]["json_schema"]
        assert p["response_format"]["type"] == "json_schema" and spec["strict"] is True
        assert spec["name"] in {c.name for c in SCHEMAS} and "structured_outputs" not in p


def test_chat_endpoint_sends_text_messages(fake_server: FakeStructuredServer, tmp_path: Path) -> None:
    record = run_bench(fake_server, tmp_path, "--endpoint", "/v1/chat/completions")
    assert record["metrics"]["constrained"]["schema_valid_rate"] == 0.5
    for p in fake_server.payloads:
        assert "JSON Schema" in p["messages"][0]["content"]
    limits = [p["max_completion_tokens"] for p in fake_server.payloads]
    longest = record["metrics"]["constrained"]["max_output_tokens"]
    assert limits[:4] == [1, 1, 300, 300] and sorted(limits[4:]) == [1, longest]  # plain: the constrained lengths


@pytest.mark.parametrize("fake_server", [{"reject_constrained": True}], indirect=True)
def test_refused_constraints_are_invalid_and_leave_no_ratio(
    fake_server: FakeStructuredServer, tmp_path: Path
) -> None:
    m = run_bench(fake_server, tmp_path, exit_code=1)["metrics"]  # nothing constrained completed
    assert m["unconstrained"]["completed"] == 2 and m["constrained"]["failed"] == 2
    assert m["schema_valid_rate"] == 0.0 and m["constrained"]["invalid_reasons"] == {"request failed": 2}
    assert (
        m["tpot_ratio_p50"] is None and m["tpot_ratio_p99"] is None and m["output_throughput_ratio"] is None
    )


def test_check_output() -> None:
    schema = SCHEMAS[0].schema
    good = json.dumps(SCHEMAS[0].example)
    assert check_output(good, "stop", schema) is None
    assert check_output(good, "length", schema) == "finish_reason length"
    assert check_output(good[:-3], "stop", schema).startswith("not JSON")
    # A raw control character inside a string: lenient grammars allow it, JSON does not.
    assert check_output(good.replace("Ada", "A\x01a"), "stop", schema).startswith("not JSON")
    assert (
        check_output(json.dumps({**SCHEMAS[0].example, "age": 7}), "stop", schema)
        == "schema: minimum at /age"
    )


def test_requests_cycle_through_every_schema_and_fit_lengths() -> None:
    reqs = structured_requests(3 * len(SCHEMAS), 100, np.random.default_rng(0))
    names = [r.case.name for r in reqs]
    assert all(names.count(c.name) == 3 for c in SCHEMAS)
    assert all(r.request.expected_output_len == 100 for r in reqs)
    rng = np.random.default_rng(0)
    assert fit_to_length([1, 2, 3], 2, [7], rng) == [2, 3]
    assert fit_to_length([1, 2, 3], 5, [7], rng) == [7, 7, 1, 2, 3]
    with pytest.raises(ValueError, match="constraint field"):
        constraint_body(SCHEMAS[0], "guided_json", False)


def test_histogram_delta_quantiles() -> None:
    def text(counts: tuple[int, int, int], total: float) -> str:
        return "\n".join([
            "# HELP h seconds", "# TYPE h histogram",
            f'h_bucket{{le="0.1",model_name="a"}} {counts[0]}',
            f'h_bucket{{le="1.0",model_name="a"}} {counts[1]}',
            f'h_bucket{{le="+Inf",model_name="a"}} {counts[2]}',
            f'h_sum{{model_name="a"}} {total}', f'h_count{{model_name="a"}} {counts[2]}',
        ])  # fmt: skip

    before = parse_samples(text((5, 5, 5), 0.25))
    after = parse_samples(text((5, 105, 105), 50.25))  # 100 new observations in (0.1, 1.0]
    delta = histogram_delta(before, after, "h")
    assert delta is not None and delta.count == 100 and delta.total == pytest.approx(50.0)
    assert delta.quantile(0.5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert delta.quantile(0.99) == pytest.approx(0.1 + 0.9 * 0.99)
    assert histogram_delta(before, after, "missing") is None
    summary_only = parse_samples("s_sum 3.0\ns_count 4\n")
    assert histogram_delta(None, summary_only, "s").summary() == {
        "count": 4.0,
        "mean_s": 0.75,
        "p50_s": None,
        "p99_s": None,
    }


def _unbounded_parts(schema: dict[str, Any], path: str = "") -> list[str]:
    """Places where a schema would let a reply grow without limit."""
    out = []
    kind = schema.get("type")
    if "enum" in schema or "const" in schema or "$ref" in schema:
        return out
    if kind == "string" and "maxLength" not in schema and "pattern" not in schema:
        out.append(f"{path}: string without maxLength")
    if kind in ("integer", "number") and not {"minimum", "maximum"} <= schema.keys():
        out.append(f"{path}: {kind} without minimum and maximum")
    if kind == "array":
        if "maxItems" not in schema:
            out.append(f"{path}: array without maxItems")
        out += _unbounded_parts(schema["items"], path + "/items")
    if kind == "object":
        if schema.get("additionalProperties") is not False:
            out.append(f"{path}: object open to more properties")
        for name, sub in schema.get("properties", {}).items():
            out += _unbounded_parts(sub, f"{path}/{name}")
    for key in ("anyOf", "oneOf"):
        for i, sub in enumerate(schema.get(key, [])):
            out += _unbounded_parts(sub, f"{path}/{key}/{i}")
    for name, sub in schema.get("$defs", {}).items():
        out += _unbounded_parts(sub, f"/$defs/{name}")
    return out


def test_every_shipped_schema_is_valid_bounded_and_has_a_valid_example() -> None:
    assert len(SCHEMAS) >= 12 and len({c.name for c in SCHEMAS}) == len(SCHEMAS)
    for case in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(case.schema)
        jsonschema.validate(case.example, case.schema)
        assert _unbounded_parts(case.schema) == [], case.name
    text = json.dumps([c.schema for c in SCHEMAS])
    for feature in (
        '"$ref"',
        '"$defs"',
        '"enum"',
        '"anyOf"',
        '"pattern"',
        '"maxItems"',
        '"additionalProperties"',
    ):
        assert feature in text


def test_server_trace_dir_adds_each_phases_ttft_stages(fake_server: FakeStructuredServer, tmp_path: Path) -> None:
    """--server-trace-dir is honoured here too: each phase gets its breakdown (bench/tail.py), here
    the note that the fake server's replies carry no id to find them in the trace by."""
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    m = run_bench(fake_server, tmp_path, "--server-trace-dir", str(trace_dir))["metrics"]
    for phase in ("unconstrained", "constrained"):
        assert m[phase]["tail"] == {"error": "no successful request carried a response id"}
