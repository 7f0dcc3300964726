"""`tokenmill bench serve`: a load generator for any OpenAI-compatible server.

Sends streaming requests (Poisson arrivals with optional burstiness, or unbounded), optionally
capped at a maximum number in flight; several caps given as "1,8,32" are run one after the other
on the same prompts. Reports what `vllm bench serve` reports, under the same JSON keys.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from tqdm import tqdm

from tokenmill.bench import copy_heavy, structured
from tokenmill.bench.datasets import (
    LocalTokenSource,
    SampleRequest,
    ServerTokenSource,
    TokenSource,
    multi_tenant_requests,
    prefix_repetition_requests,
    random_requests,
    to_text_prompts,
)
from tokenmill.bench.prometheus_text import scrape
from tokenmill.bench.results import DEFAULT_RESULTS_DIR, write_result
from tokenmill.bench.saturation import format_saturated_window, saturated_window
from tokenmill.bench.serve_client import build_payload, is_chat_endpoint, send_request
from tokenmill.bench.serve_metrics import (
    RequestResult,
    ServeRun,
    compute_metrics,
    format_report,
    latency_samples,
    parse_goodput,
)
from tokenmill.bench.slo_mix import assign_priorities, format_slo_report, parse_priority_mix, slo_report
from tokenmill.bench.spec_decode import format_spec_decode, spec_decode_summary, totals_from_samples
from tokenmill.slo import parse_slo_classes

REQUEST_TIMEOUT_S = 6 * 3600


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument(
        "--base-url", default=None, help="e.g. http://127.0.0.1:8000 (overrides --host/--port)"
    )
    server.add_argument("--host", default="127.0.0.1", help="the server's host")
    server.add_argument("--port", type=int, default=8000, help="the server's port")
    server.add_argument(
        "--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions"
    )
    server.add_argument(
        "--model", default=None, help="model name to send (default: first entry of /v1/models)"
    )
    server.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    server.add_argument(
        "--tokenizer", default=None, help="local HF tokenizer for prompts (default: the server's /tokenize)"
    )

    data = parser.add_argument_group("dataset")
    data.add_argument(
        "--dataset-name",
        choices=("random", "prefix-repetition", "multi-tenant", "json-schema", "copy-heavy"),
        default="random",
        help="random: random token ids; prefix-repetition: prompts sharing a few prefixes (prefix cache); "
        "multi-tenant: tenants' system prompts, each shared by many users' requests (the router's case); "
        "json-schema: structured output, each prompt plain then constrained by its JSON schema; "
        "copy-heavy: text prompts to rewrite / edit / extract from (n-gram speculation's case)",
    )
    data.add_argument("--num-prompts", type=int, default=1000, help="requests to send")
    data.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (random dataset)")
    data.add_argument("--random-output-len", type=int, default=128, help="max_tokens (random dataset)")
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [L(1-r), L(1+r)], 0 <= r < 1",
    )
    data.add_argument(
        "--prefix-repetition-prefix-len", type=int, default=256, help="tokens of each shared prefix"
    )
    data.add_argument(
        "--prefix-repetition-suffix-len", type=int, default=256, help="tokens after the prefix, per prompt"
    )
    data.add_argument(
        "--prefix-repetition-num-prefixes", type=int, default=10, help="distinct shared prefixes"
    )
    data.add_argument(
        "--prefix-repetition-output-len", type=int, default=128, help="max_tokens (prefix-repetition)"
    )

    data.add_argument("--multi-tenant-num-tenants", type=int, default=16, help="tenants (multi-tenant)")
    data.add_argument(
        "--multi-tenant-system-len", default="400,800", help="MIN,MAX tokens of a tenant's system prompt"
    )
    data.add_argument("--multi-tenant-user-len", type=int, default=32, help="tokens of each user message")
    data.add_argument("--multi-tenant-output-len", type=int, default=32, help="max_tokens (multi-tenant)")

    structured.add_cli_args(parser)
    copy_heavy.add_cli_args(parser)

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson; <1 burstier)"
    )
    load.add_argument(
        "--max-concurrency", default=None, help="max requests in flight; a list like 1,8,32 runs a sweep"
    )
    load.add_argument("--num-warmups", type=int, default=0, help="untimed requests sent first")
    load.add_argument(
        "--ignore-eos", action="store_true", help="ask the server to always generate max tokens"
    )
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    load.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    load.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrival times")
    load.add_argument(
        "--priority-mix",
        default=None,
        help="PRIORITY:WEIGHT,... e.g. 0:0.3,1:0.7: each request's `priority`, drawn with the seed (bench/slo_mix.py)",
    )
    load.add_argument(
        "--no-priority-field",
        action="store_true",
        help="with --priority-mix: do not send `priority` (a server under fcfs refuses it); the classes "
        "only group the report",
    )
    load.add_argument("--disable-tqdm", action="store_true", help="no progress bar")

    report = parser.add_argument_group("report")
    report.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        help='SLOs in ms, e.g. "ttft:500 tpot:50" (keys: ttft, tpot, e2el)',
    )
    report.add_argument(
        "--slo-classes",
        default=None,
        help="per-priority SLOs to report attainment and goodput against, PRIORITY=TTFT_MS/TPOT_MS,... "
        "(the server's --slo-class syntax), e.g. 0=1500/300,1=8000/600; needs --priority-mix",
    )
    report.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 90,99")
    report.add_argument(
        "--server-trace-dir",
        default=None,
        help="the --trace-dir of a server on this host: add where the slowest 1%% of requests spent "
        "their time (bench/tail.py) to the report and the result",
    )
    report.add_argument("--save-result", action="store_true", help="write a JSON result per run")
    report.add_argument("--result-dir", default=DEFAULT_RESULTS_DIR, help="where --save-result writes")
    report.add_argument("--result-filename", default=None, help="base file name (a sweep appends -c<N>)")
    report.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="PNG",
        help="write charts (default path: in --result-dir)",
    )


def parse_concurrencies(value: str | int | None) -> list[int | None]:
    if value is None or value == "":
        return [None]
    if isinstance(value, int):
        items = [value]
    else:
        try:
            items = [int(v) for v in str(value).replace(" ", "").split(",") if v]
        except ValueError as exc:
            raise ValueError(f"--max-concurrency must be integers like 8 or 1,8,32, got {value!r}") from exc
    if not items or any(c < 1 for c in items):
        raise ValueError(f"--max-concurrency values must be >= 1, got {value!r}")
    return list(items)


def arrival_offsets(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the start: gamma-distributed gaps with mean 1/rate (0 when rate is inf)."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if np.isinf(request_rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes at once
    return np.cumsum(gaps)


async def run_load(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str],
    requests: list[SampleRequest],
    payloads: list[dict[str, Any]],
    offsets: np.ndarray,
    max_concurrency: int | None,
    show_progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Send every request at its offset, at most `max_concurrency` at a time; return results and duration."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    progress = tqdm(total=len(requests), disable=not show_progress, desc="requests")

    async def one(req: SampleRequest, payload: dict[str, Any]) -> RequestResult:
        if limit is None:
            result = await send_request(session, url, payload, headers, req.prompt_len)
        else:
            async with limit:
                result = await send_request(session, url, payload, headers, req.prompt_len)
        progress.update(1)
        return result

    start = time.perf_counter()
    tasks = []
    for req, payload, offset in zip(requests, payloads, offsets, strict=True):
        delay = start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, payload)))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    progress.close()
    return list(results), duration


async def first_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    async with session.get(base_url + "/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(
                f"GET {base_url}/v1/models answered HTTP {resp.status}: {(await resp.text())[:300]}"
            )
        data = (await resp.json()).get("data") or []
    if not data:
        raise RuntimeError(f"GET {base_url}/v1/models lists no models; pass --model")
    return data[0]["id"]


async def build_requests(args: argparse.Namespace, source: TokenSource) -> list[SampleRequest]:
    if args.dataset_name == "copy-heavy":

        async def count_tokens(text: str) -> int:
            return len(await source.encode(text))

        return await copy_heavy.copy_heavy_requests(
            args.num_prompts,
            args.seed,
            count_tokens,
            args.copy_heavy_min_input_len,
            args.copy_heavy_max_input_len,
            args.copy_heavy_output_len,
        )
    rng = np.random.default_rng(args.seed)
    pool = await source.token_pool()
    if args.dataset_name == "random":
        return random_requests(
            pool,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            rng,
        )
    if args.dataset_name == "multi-tenant":
        return multi_tenant_requests(
            pool,
            args.num_prompts,
            args.multi_tenant_num_tenants,
            _min_max(args.multi_tenant_system_len, "--multi-tenant-system-len"),
            args.multi_tenant_user_len,
            args.multi_tenant_output_len,
            rng,
        )
    return prefix_repetition_requests(
        pool,
        args.num_prompts,
        args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len,
        args.prefix_repetition_num_prefixes,
        args.prefix_repetition_output_len,
        rng,
    )


def _min_max(text: str, flag: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in str(text).split(","))
    except ValueError:
        raise ValueError(f"{flag} must be MIN,MAX token counts like 400,800, got {text!r}") from None
    return low, high


def base_run_config(args: argparse.Namespace, base_url: str, model: str, max_concurrency: int | None) -> dict:
    """The result file's `config` keys every `bench serve` workload shares."""
    return {
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "tokenizer": args.tokenizer,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate,
        "burstiness": args.burstiness,
        "max_concurrency": max_concurrency,
        "ignore_eos": args.ignore_eos,
        "temperature": args.temperature,
        "num_warmups": args.num_warmups,
        "seed": args.seed,
    }


def _run_config(args: argparse.Namespace, base_url: str, model: str, max_concurrency: int | None) -> dict:
    config = base_run_config(args, base_url, model, max_concurrency)
    config["goodput"] = parse_goodput(args.goodput)
    config["priority_mix"] = args.priority_mix
    config["slo_classes"] = args.slo_classes
    if args.dataset_name == "random":
        config |= {
            k: getattr(args, k) for k in ("random_input_len", "random_output_len", "random_range_ratio")
        }
    elif args.dataset_name == "multi-tenant":
        config |= {
            f"multi_tenant_{k}": getattr(args, f"multi_tenant_{k}")
            for k in ("num_tenants", "system_len", "user_len", "output_len")
        }
    elif args.dataset_name == "copy-heavy":
        config |= {
            f"copy_heavy_{k}": getattr(args, f"copy_heavy_{k}")
            for k in ("min_input_len", "max_input_len", "output_len")
        }
    else:
        prefix_keys = ("prefix_len", "suffix_len", "num_prefixes", "output_len")
        config |= {f"prefix_repetition_{k}": getattr(args, f"prefix_repetition_{k}") for k in prefix_keys}
    return config


def print_failures(results: list[RequestResult]) -> None:
    errors = Counter(r.error for r in results if not r.success)
    for error, count in errors.most_common(5):
        print(f"  {count} failed: {error}", file=sys.stderr)


async def run_benchmark(args: argparse.Namespace) -> list[ServeRun]:
    """Run every requested concurrency; return one `ServeRun` per run (results printed and saved as asked)."""
    if args.dataset_name == "json-schema":
        # Imported here: that module drives its phases with this one's load generator.
        from tokenmill.bench.structured_serve import run_structured

        return await run_structured(args)
    slos = parse_goodput(args.goodput)  # refuse bad flags before sending anything
    priority_mix = parse_priority_mix(args.priority_mix) if args.priority_mix else None
    if args.slo_classes and priority_mix is None:
        raise ValueError("--slo-classes judges requests by their priority: give --priority-mix too")
    if args.slo_classes:
        parse_slo_classes(args.slo_classes)
    concurrencies = parse_concurrencies(args.max_concurrency)
    percentiles = tuple(float(p) for p in str(args.metric_percentiles).split(",") if p.strip())
    extra_body = json.loads(args.extra_body) if args.extra_body else None
    if extra_body is not None and not isinstance(extra_body, dict):
        raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = base_url + "/" + args.endpoint.lstrip("/")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    chat = is_chat_endpoint(args.endpoint)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base_name = (args.result_filename or f"serve-{args.dataset_name}-{stamp}").removesuffix(".json")

    # Unbounded connections: aiohttp's default pool of 100 would silently cap the load.
    connector = aiohttp.TCPConnector(limit=0 if None in concurrencies else max(concurrencies))
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = args.model or await first_model(session, base_url, headers)
        source = (
            LocalTokenSource(args.tokenizer)
            if args.tokenizer
            else ServerTokenSource(session, base_url, model, headers)
        )
        requests = await build_requests(args, source)
        if chat:
            await to_text_prompts(requests, source)
        payloads = [
            build_payload(r, model, chat, args.ignore_eos, args.temperature, extra_body) for r in requests
        ]
        priorities = assign_priorities(len(requests), priority_mix, args.seed) if priority_mix else None
        if priorities is not None and not args.no_priority_field:
            for payload, priority in zip(payloads, priorities, strict=True):
                payload["priority"] = priority

        if args.num_warmups > 0:
            print(f"Warming up with {args.num_warmups} requests...")
            warm = [i % len(requests) for i in range(args.num_warmups)]
            warm_limit = max((c for c in concurrencies if c is not None), default=None)
            results, _ = await run_load(
                session, url, headers, [requests[i] for i in warm], [payloads[i] for i in warm],
                np.zeros(len(warm)), warm_limit, show_progress=False,
            )  # fmt: skip
            if not any(r.success for r in results):
                print_failures(results)
                raise RuntimeError("every warm-up request failed; is the server healthy?")

        runs = []
        for max_concurrency in concurrencies:
            offsets = arrival_offsets(
                len(requests), args.request_rate, args.burstiness, np.random.default_rng(args.seed + 1)
            )
            print(f"Model {model} at {url}: {len(requests)} requests, rate {args.request_rate}, "
                  f"burstiness {args.burstiness}, max concurrency {max_concurrency or 'inf'}")  # fmt: skip
            # The server's speculative decoding counters, read around the run (none: not speculating).
            spec_before = totals_from_samples(await scrape(session, base_url, headers))
            results, duration = await run_load(
                session, url, headers, requests, payloads, offsets, max_concurrency, not args.disable_tqdm
            )
            spec_after = totals_from_samples(await scrape(session, base_url, headers))
            metrics = compute_metrics(results, duration, slos, percentiles)
            metrics["max_concurrency"] = max_concurrency
            metrics["rejected_429"] = sum(r.error.startswith("HTTP 429") for r in results)
            print(format_report(metrics, max_concurrency, args.request_rate))
            if (window := saturated_window(results, max_concurrency)) is not None:
                metrics["saturated_window"] = window
                print(format_saturated_window(window, max_concurrency))
            if priorities is not None:
                metrics["slo"] = slo_report(results, priorities, args.slo_classes, duration)
                print(format_slo_report(metrics["slo"]))
            spec_decode = spec_decode_summary(spec_before, spec_after)
            if spec_decode is not None:
                metrics["spec_decode"] = spec_decode
                print(format_spec_decode(spec_decode))
            if args.server_trace_dir:
                from tokenmill.bench.tail import TRACE_SETTLE_S, format_tail, tail_report

                await asyncio.sleep(TRACE_SETTLE_S)  # the engine flushes its step records when idle
                metrics["tail"] = tail_report(results, args.server_trace_dir)
                print(format_tail(metrics["tail"]))
            print_failures(results)
            runs.append(ServeRun(max_concurrency, metrics, latency_samples(results)))
            if args.save_result:
                name = base_name if len(concurrencies) == 1 else f"{base_name}-c{max_concurrency or 'inf'}"
                config = _run_config(args, base_url, model, max_concurrency)
                path = write_result("serve", config, metrics, args.result_dir, name)
                print(f"Saved {path}")

    if args.plot is not None:
        from tokenmill.bench.plot import plot_serve_runs  # matplotlib loads only when asked for

        plot_path = Path(args.plot) if args.plot else Path(args.result_dir) / f"{base_name}.png"
        title = f"{model}: {args.dataset_name}, {args.num_prompts} prompts, rate {args.request_rate}"
        print(f"Saved {plot_serve_runs(runs, plot_path, title)}")
    return runs


def main(args: argparse.Namespace) -> int:
    """Entry point for `tokenmill bench serve`; 0 when every run completed at least one request."""
    try:
        runs = asyncio.run(run_benchmark(args))
    except (ValueError, RuntimeError, aiohttp.ClientError) as exc:
        print(f"bench serve: error: {exc}", file=sys.stderr)
        return 1
    return 0 if all(run.metrics["completed"] > 0 for run in runs) else 1


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tokenmill bench serve", description=__doc__)
    add_cli_args(_parser)
    sys.exit(main(_parser.parse_args()))
