"""`tokenmill bench serve --dataset-name json-schema`: the cost of structured output, in one run.

At each concurrency the same prompts go to the same server twice, back to back: first plain
(unconstrained, the baseline), then each with its JSON schema as a constraint. Reported per
phase: output tok/s, TPOT and TTFT p50/p99; for the constrained phase also the share of replies
that parse and validate against their schema, and the server's grammar compile and per-step
mask times from /metrics (null, with a note, when the server does not export them). Warm-ups are
plain requests, so the constrained phase's compile times include each schema's first compile.
Before the phases every prompt is sent once for one token, so both phases find their prompts in
the prefix cache alike. In a sweep (--max-concurrency 8,64) only the first concurrency's compile
times are first compiles: later ones find the server's compiled grammars cached, if it keeps them.
With --server-trace-dir (the server's --trace-dir on this host) each phase also reports its TTFT
split by stage (bench/tail.py), so the two phases' stages compare in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
from collections import Counter
from typing import Any

import aiohttp
import numpy as np

from tokenmill.bench import serve
from tokenmill.bench.datasets import LocalTokenSource, ServerTokenSource, TokenSource, to_text_prompts
from tokenmill.bench.prometheus_text import Samples, histogram_delta, scrape
from tokenmill.bench.results import write_result
from tokenmill.bench.serve_client import build_payload, is_chat_endpoint
from tokenmill.bench.serve_metrics import (
    RequestResult,
    ServeRun,
    compute_metrics,
    format_report,
    latency_samples,
)
from tokenmill.bench.structured import (
    COMPILE_METRIC,
    MASK_METRIC,
    StructuredRequest,
    check_output,
    constraint_body,
    fit_to_length,
    structured_requests,
)
from tokenmill.bench.tail import TRACE_SETTLE_S, format_tail, tail_report

# p50 and p99 are what this workload reports, whatever --metric-percentiles adds.
REPORTED_PERCENTILES = (50.0, 99.0)


async def _prompts_as_ids(
    items: list[StructuredRequest], source: TokenSource, length: int, rng: np.random.Generator
) -> None:
    """Replace each text prompt by exactly `length` token ids, in place."""
    pool = await source.token_pool()
    encoded: dict[str, list[int]] = {}
    for item in items:
        text = item.request.prompt
        assert isinstance(text, str)
        if text not in encoded:  # one /tokenize per schema, not per request
            encoded[text] = await source.encode(text)
        item.request.prompt = fit_to_length(encoded[text], length, pool, rng)
        item.request.prompt_len = length


def _validity(items: list[StructuredRequest], results: list[RequestResult]) -> dict[str, Any]:
    """Share of requests whose reply validates; a failed request or a reply cut by max_tokens is invalid."""
    reasons: Counter[str] = Counter()
    per_schema: dict[str, list[int]] = {}
    finish: Counter[str] = Counter()
    for item, result in zip(items, results, strict=True):
        if not result.success:
            reason: str | None = "request failed"
        else:
            finish[result.finish_reason or "none"] += 1
            reason = check_output(result.generated_text, result.finish_reason, item.case.schema)
        if reason is not None:
            reasons[reason] += 1
        per_schema.setdefault(item.case.name, []).append(reason is None)
    valid = sum(sum(v) for v in per_schema.values())
    return {
        "schema_valid": valid,
        "schema_invalid": len(results) - valid,
        "schema_valid_rate": valid / len(results) if results else None,
        "schema_valid_rate_by_schema": {k: sum(v) / len(v) for k, v in sorted(per_schema.items())},
        "invalid_reasons": dict(reasons.most_common(10)),
        # The longest reply, against max_tokens: how much headroom the bound on the schemas left.
        "max_output_tokens": max((r.output_tokens for r in results if r.success), default=0),
        "finish_reasons": dict(finish),
    }


def tokens_per_text_chunk(results: list[RequestResult]) -> float | None:
    """Output tokens per streamed chunk that carried text, over the successful requests: how many
    SSE events the server formatted and wrote for the phase's tokens. Two phases with the same
    tokens but different values put different loads on the API server (a plain reply's tokens that
    add no text yet send no chunk)."""
    ok = [r for r in results if r.success]
    chunks = sum(len(r.itl) + 1 for r in ok if r.generated_text)
    return sum(r.output_tokens for r in ok) / chunks if chunks else None


def _server_timings(before: Samples | None, after: Samples | None) -> dict[str, Any]:
    """Compile and per-step mask time gained during the constrained phase (null when not exported)."""
    missing = []
    out: dict[str, Any] = {}
    for key, name in (("grammar_compile", COMPILE_METRIC), ("grammar_mask_per_step", MASK_METRIC)):
        delta = histogram_delta(before, after, name) if after is not None else None
        out[key] = delta.summary() if delta is not None else None
        if delta is None:
            missing.append(name)
    if after is None:
        out["server_metrics_note"] = "the server's /metrics could not be read"
    elif missing:
        out["server_metrics_note"] = f"not in the server's /metrics: {', '.join(missing)}"
    else:
        out["server_metrics_note"] = None
    return out


def _ratio(a: Any, b: Any) -> float | None:
    return float(a) / float(b) if a is not None and b else None


def combine(
    plain: dict[str, Any], constrained: dict[str, Any], validity: dict[str, Any], timings: dict[str, Any]
) -> dict[str, Any]:
    """One result's metrics: both phases in full, and the comparison on top (null ratios when a
    phase completed nothing: its latencies are placeholders, not measurements)."""
    both = plain["completed"] > 0 and constrained["completed"] > 0

    def ratio(key: str) -> float | None:
        return _ratio(constrained[key], plain[key]) if both else None

    return {
        "unconstrained": plain,
        "constrained": {**constrained, **validity, **timings},
        "tpot_ratio_p50": ratio("median_tpot_ms"),
        "tpot_ratio_p99": ratio("p99_tpot_ms"),
        "output_throughput_ratio": ratio("output_throughput"),
        "schema_valid_rate": validity["schema_valid_rate"],
    }


def format_summary(metrics: dict[str, Any]) -> str:
    plain, con = metrics["unconstrained"], metrics["constrained"]
    lines = ["{s:{c}^66}".format(s=" Structured output vs plain ", c="=")]
    lines.append(f"{'':<28}{'plain':>12}{'constrained':>14}{'ratio':>12}")

    both = plain["completed"] > 0 and con["completed"] > 0

    def row(label: str, key: str, fmt: str = ".2f") -> None:
        ratio = _ratio(con[key], plain[key]) if both else None
        ratio_text = "" if ratio is None else f"{ratio:.3f}"
        lines.append(f"{label:<28}{plain[key]:>12{fmt}}{con[key]:>14{fmt}}{ratio_text:>12}")

    row("Output tok/s", "output_throughput")
    row("TPOT p50 (ms)", "median_tpot_ms")
    row("TPOT p99 (ms)", "p99_tpot_ms")
    row("TTFT p50 (ms)", "median_ttft_ms")
    row("TTFT p99 (ms)", "p99_ttft_ms")
    row("Output tokens", "total_output_tokens", "d")
    if plain.get("tokens_per_text_chunk") and con.get("tokens_per_text_chunk"):
        row("Tokens per text chunk", "tokens_per_text_chunk", ".3f")
    rate = con["schema_valid_rate"]
    lines.append(f"Schema-valid replies: {con['schema_valid']}/{con['schema_valid'] + con['schema_invalid']}"
                 + ("" if rate is None else f" ({rate:.1%})"))  # fmt: skip
    lines.append(f"Longest constrained reply: {con['max_output_tokens']} tokens")
    if con["invalid_reasons"]:
        lines.append(f"Invalid: {json.dumps(con['invalid_reasons'])}")
    for key in ("grammar_compile", "grammar_mask_per_step"):
        s = con[key]
        if s is None:
            lines.append(f"{key}: n/a")
        else:
            ms = {k: None if s[k] is None else round(s[k] * 1000, 3) for k in ("mean_s", "p50_s", "p99_s")}
            lines.append(
                f"{key} (ms): count {s['count']:g}, mean {ms['mean_s']}, p50 {ms['p50_s']}, p99 {ms['p99_s']}"
            )
    if con["server_metrics_note"]:
        lines.append(f"Note: {con['server_metrics_note']}")
    lines.append("=" * 66)
    return "\n".join(lines)


def _config(args: argparse.Namespace, base_url: str, model: str, max_concurrency: int | None) -> dict:
    config = serve.base_run_config(args, base_url, model, max_concurrency)
    # --ignore-eos applies to the unconstrained phase only (a finished grammar allows only EOS).
    config["ignore_eos_unconstrained"] = config.pop("ignore_eos")
    return config | {
        "structured_output_len": args.structured_output_len,
        "structured_input_len": args.structured_input_len,
        "structured_output_field": args.structured_output_field,
        "disable_any_whitespace": not args.structured_any_whitespace,
        "compile_metric": COMPILE_METRIC,
        "mask_metric": MASK_METRIC,
        "phase_order": ["constrained", "unconstrained"],
        "unconstrained_lengths": "each prompt's constrained reply length, ignore_eos",
        "prefix_cache_primed": True,
    }


def matched_plain_payloads(
    plain_payloads: list[dict[str, Any]], constrained: list[RequestResult], limit_key: str
) -> list[dict[str, Any]]:
    """The plain requests, each limited to (and forced to reach, ignore_eos) the output length of
    the same prompt's constrained reply; a failed constrained request keeps its plain limit."""
    matched = []
    for payload, result in zip(plain_payloads, constrained, strict=True):
        if result.success and result.output_tokens > 0:
            payload = {**payload, limit_key: result.output_tokens, "ignore_eos": True}
        matched.append(payload)
    return matched


async def run_structured(args: argparse.Namespace) -> list[ServeRun]:
    """Both phases at every concurrency; one result file per concurrency."""
    concurrencies = serve.parse_concurrencies(args.max_concurrency)
    percentiles = tuple(
        sorted(
            {*REPORTED_PERCENTILES, *(float(p) for p in str(args.metric_percentiles).split(",") if p.strip())}
        )
    )
    extra_body = json.loads(args.extra_body) if args.extra_body else None
    if extra_body is not None and not isinstance(extra_body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    if args.num_prompts < 1 or args.structured_output_len < 1 or args.structured_input_len < 0:
        raise ValueError(
            "--num-prompts and --structured-output-len must be >= 1, --structured-input-len >= 0"
        )
    if args.plot is not None:
        raise ValueError("--plot is not supported with --dataset-name json-schema")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = base_url + "/" + args.endpoint.lstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chat = is_chat_endpoint(args.endpoint)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base_name = (args.result_filename or f"serve-json-schema-{stamp}").removesuffix(".json")
    rng = np.random.default_rng(args.seed)

    connector = aiohttp.TCPConnector(limit=0 if None in concurrencies else max(concurrencies))
    timeout = aiohttp.ClientTimeout(total=serve.REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = args.model or await serve.first_model(session, base_url, headers)
        items = structured_requests(args.num_prompts, args.structured_output_len, rng)
        if args.structured_input_len > 0:
            source: TokenSource = (
                LocalTokenSource(args.tokenizer)
                if args.tokenizer
                else ServerTokenSource(session, base_url, model, headers)
            )
            await _prompts_as_ids(items, source, args.structured_input_len, rng)
            if chat:
                await to_text_prompts([i.request for i in items], source)
        requests = [i.request for i in items]
        plain_payloads = [
            build_payload(r, model, chat, args.ignore_eos, args.temperature, extra_body) for r in requests
        ]
        # ignore_eos stays off when constrained: once the grammar ends only EOS is allowed.
        constrained_payloads = [
            build_payload(i.request, model, chat, False, args.temperature, extra_body)
            | constraint_body(i.case, args.structured_output_field, args.structured_any_whitespace)
            for i in items
        ]

        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} plain requests...")
            warm = [i % len(requests) for i in range(args.num_warmups)]
            warm_limit = max((c for c in concurrencies if c is not None), default=None)
            results, _ = await serve.run_load(
                session, url, headers, [requests[i] for i in warm], [plain_payloads[i] for i in warm],
                np.zeros(len(warm)), warm_limit, show_progress=False,
            )  # fmt: skip
            if not any(r.success for r in results):
                serve.print_failures(results)
                raise RuntimeError("every warm-up request failed; is the server healthy?")

        # Each prompt once, for one token: the prefix cache then holds every prompt before either
        # phase, so the phase that went second would not get its prefills for free.
        print(f"Priming the prefix cache with {len(requests)} one-token requests...")
        limit_key = "max_completion_tokens" if chat else "max_tokens"
        prime_payloads = [{**p, limit_key: 1} for p in plain_payloads]
        prime_limit = max((c for c in concurrencies if c is not None), default=None)
        results, _ = await serve.run_load(
            session, url, headers, requests, prime_payloads, np.zeros(len(requests)), prime_limit, False
        )
        if not any(r.success for r in results):
            serve.print_failures(results)
            raise RuntimeError("every priming request failed; is the server healthy?")

        runs = []
        for max_concurrency in concurrencies:
            phases: dict[str, tuple[list[RequestResult], dict[str, Any]]] = {}
            before = after = None
            # Constrained first; then the same prompts unconstrained, each generating exactly as many
            # tokens as its constrained reply (ignore_eos), so both phases decode the same lengths
            # at the same contexts and their TPOTs compare the constraint, not the reply lengths.
            for phase in ("constrained", "unconstrained"):
                if phase == "constrained":
                    payloads = constrained_payloads
                else:
                    payloads = matched_plain_payloads(plain_payloads, phases["constrained"][0], limit_key)
                offsets = serve.arrival_offsets(
                    len(requests), args.request_rate, args.burstiness, np.random.default_rng(args.seed + 1)
                )
                print(f"{phase}: model {model} at {url}, {len(requests)} requests, "
                      f"max concurrency {max_concurrency or 'inf'}")  # fmt: skip
                if phase == "constrained":
                    before = await scrape(session, base_url, headers)
                results, duration = await serve.run_load(
                    session, url, headers, requests, payloads, offsets, max_concurrency, not args.disable_tqdm
                )
                if phase == "constrained":
                    after = await scrape(session, base_url, headers)
                metrics = compute_metrics(results, duration, None, percentiles)
                metrics["tokens_per_text_chunk"] = tokens_per_text_chunk(results)
                print(format_report(metrics, max_concurrency, args.request_rate))
                if args.server_trace_dir:  # each phase's TTFT by stage, from the server's trace
                    await asyncio.sleep(TRACE_SETTLE_S)  # the engine flushes its step records when idle
                    metrics["tail"] = tail_report(results, args.server_trace_dir)
                    print(format_tail(metrics["tail"]))
                serve.print_failures(results)
                phases[phase] = (results, metrics)

            con_results, con_metrics = phases["constrained"]
            metrics = combine(
                phases["unconstrained"][1],
                con_metrics,
                _validity(items, con_results),
                _server_timings(before, after),
            )
            metrics["max_concurrency"] = max_concurrency
            # What `bench serve` judges a run by: here both phases must have completed something.
            metrics["completed"] = min(phases[p][1]["completed"] for p in phases)
            print(format_summary(metrics))
            runs.append(ServeRun(max_concurrency, metrics, latency_samples(con_results)))
            if args.save_result:
                name = base_name if len(concurrencies) == 1 else f"{base_name}-c{max_concurrency or 'inf'}"
                config = _config(args, base_url, model, max_concurrency)
                config["schemas"] = sorted({i.case.name for i in items})
                path = write_result("serve", config, metrics, args.result_dir, name)
                print(f"Saved {path}")
    return runs
