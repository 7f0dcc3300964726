"""Soak load against a real `tokenmill serve`: mixed traffic, faults caused by clients, then an audit.

    python -m tests.reliability.soak --duration 600 --concurrency 16
    python -m tests.reliability.soak --base-url http://127.0.0.1:8000 --duration 120

Without --base-url it starts its own server (a tiny random checkpoint on CPU unless --model is
given, with small queue and KV limits so that bursts hit admission control and the scheduler
preempts), and after the audit sends it SIGTERM and checks that no process outlives it.

Traffic (weights are flags): streaming and non-streaming chat and completions with n in 1..3,
some with `ignore_eos`, stop strings, logprobs, shared prefixes; clients that disconnect
mid-stream or give up on a non-streaming request; per-request deadlines (`request_timeout`);
prompts longer than the context (400); bad parameters (400 / 404); and bursts of many requests
at once (200 or 429). Every request's outcome is recorded and checked:

- exactly one terminal outcome each: a complete answer (every choice one finish_reason; a stream
  ends with one `data: [DONE]` and nothing after it), an error status with OpenAI's error body,
  an error event in the stream, or a disconnect this script caused; never a 5xx, a hang or a
  dropped connection;
- `ignore_eos` requests that complete get exactly max_tokens tokens per choice;
- after the drain: nothing running or waiting, no KV block held (kv_cache_usage_perc == 0: every
  block free or cached with ref count 0), and the server counted each admitted sequence as
  finished exactly once (request_success_total grew by the number of admitted sequences).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.reliability.server_tools import (
    engine_invariants,
    finished_by_reason,
    metric,
    openai_error_problem,
    process_tree,
    response_error_problem,
    survivors,
    wait_idle,
)

_WORD_TEXT = (
    "the model reads a prompt and writes tokens one by one while the server streams them to a client "
    "that may leave at any time so every block of cache must return to the pool when a request ends "
    "paris france river mountain ocean forest city garden number seven eleven hundred quick brown fox"
)
WORDS = _WORD_TEXT.split()
# Every prompt with a shared prefix starts with one of these, so the prefix cache gets hits, and
# aborts and preemptions meet blocks other requests share.
SHARED_PREFIXES = [" ".join(random.Random(k).choices(WORDS, k=60)) for k in range(3)]

# Bad requests and the status each must get. All are refused before reaching the engine.
BAD_PARAMS: list[tuple[str, dict[str, Any], int]] = [
    ("temperature<0", {"temperature": -1}, 400),
    ("top_p>1", {"top_p": 1.5}, 400),
    ("n=0", {"n": 0}, 400),
    ("n huge", {"n": 100_000}, 400),
    ("max_tokens=0", {"max_tokens": 0}, 400),
    ("max_tokens beyond context", {"max_tokens": 10**9}, 400),
    ("unknown model", {"model": "no-such-model"}, 404),
    ("presence_penalty>2", {"presence_penalty": 5}, 400),
    ("min_p>1", {"min_p": 2}, 400),
    ("repetition_penalty=0", {"repetition_penalty": 0}, 400),
    ("too many stop strings", {"stop": ["x"] * 100}, 400),
    ("seed not an int", {"seed": "abc"}, 400),
    ("min_tokens>max_tokens", {"min_tokens": 9, "max_tokens": 4}, 400),
    ("nan temperature", {"temperature": "NaN"}, 400),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, 400),
]

DEFAULT_SERVER_ARGS = [
    "--max-model-len", "256",
    "--max-num-seqs", "8",
    "--num-kv-blocks", "48",  # 768 tokens for up to 8 sequences of up to 256: the scheduler preempts
    # Ordinary traffic mostly fits; a burst of 40 at once does not: 429 with Retry-After.
    "--max-num-waiting-seqs", "16",
    "--shutdown-timeout", "10",
    "--enable-debug-endpoints",  # GET /debug/invariants after the drain
]  # fmt: skip


@dataclass
class SoakConfig:
    duration_s: float = 45.0
    concurrency: int = 12
    # Relative weights of the request kinds each client picks from.
    weight_stream: float = 30
    weight_nonstream: float = 22
    weight_stream_disconnect: float = 25
    weight_nonstream_disconnect: float = 5
    weight_deadline: float = 5
    weight_oversized: float = 5
    weight_bad_params: float = 8
    burst_every_s: float = 8.0  # 0 turns bursts off
    burst_size: int = 40
    max_tokens: int = 48
    seed: int = 0
    request_timeout_s: float = 180.0  # a client waiting longer than this counts as a hang


@dataclass
class Outcome:
    kind: str
    endpoint: str
    stream: bool
    num_sequences: int  # engine sequences the request asks for: prompts x n
    terminal: str = ""  # completed | error_status | error_event | client_disconnect | violation
    status: int | None = None
    finish_reasons: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    expected_tokens: int | None = None
    problems: list[str] = field(default_factory=list)
    latency_s: float = 0.0


@dataclass
class Meta:
    """What the request builder knows about the body it made."""

    kind: str
    endpoint: str
    stream: bool
    num_prompts: int = 1
    n: int = 1
    max_tokens: int | None = None
    ignore_eos: bool = False
    include_usage: bool = False
    expected_status: int = 200
    disconnect_after_events: int = 0  # stream_disconnect: leave after this many data events
    client_timeout_s: float | None = None  # nonstream_disconnect: give up after this long
    deadline_s: float | None = None


class RequestFactory:
    def __init__(self, rng: random.Random, model: str, max_model_len: int, config: SoakConfig) -> None:
        self.rng = rng
        self.model = model
        self.max_model_len = max_model_len
        self.config = config

    def text(self, num_words: int) -> str:
        return " ".join(self.rng.choices(WORDS, k=num_words))

    def prompt_text(self, short: bool = False) -> str:
        body = self.text(self.rng.randint(1, 10 if short else 40))
        if not short and self.rng.random() < 0.35:
            return f"{self.rng.choice(SHARED_PREFIXES)} {body}"
        return body

    def base(self, meta: Meta, short_prompt: bool) -> dict[str, Any]:
        """A valid request; `short_prompt` leaves room in the context for a long generation."""
        rng = self.rng
        body: dict[str, Any] = {"model": self.model}
        if meta.endpoint == "chat":
            messages = [{"role": "user", "content": self.prompt_text(short_prompt)}]
            if rng.random() < 0.2:
                messages.insert(0, {"role": "system", "content": self.text(8)})
            body["messages"] = messages
        elif rng.random() < 0.15:
            meta.num_prompts = 2
            body["prompt"] = [self.prompt_text(short_prompt), self.prompt_text(short_prompt)]
        else:
            body["prompt"] = self.prompt_text(short_prompt)
        meta.n = rng.choice([1, 1, 1, 2, 3])
        meta.max_tokens = rng.randint(1, self.config.max_tokens)
        meta.ignore_eos = rng.random() < 0.5
        body.update(n=meta.n, max_tokens=meta.max_tokens, ignore_eos=meta.ignore_eos)
        body["temperature"] = rng.choice([0.0, 0.0, 0.7, 1.0])
        if rng.random() < 0.3:
            body["seed"] = rng.randint(0, 2**31)
        if rng.random() < 0.2:
            body["top_k"] = rng.choice([5, 50])
        if not meta.ignore_eos and rng.random() < 0.3:
            body["stop"] = rng.sample(WORDS, 2)
        if rng.random() < 0.15:
            if meta.endpoint == "chat":
                body.update(logprobs=True, top_logprobs=rng.randint(0, 3))
            else:
                body["logprobs"] = rng.randint(0, 3)
        if meta.stream:
            body["stream"] = True
            meta.include_usage = rng.random() < 0.7
            if meta.include_usage:
                body["stream_options"] = {"include_usage": True}
        return body

    def make(self, kind: str) -> tuple[Meta, dict[str, Any] | bytes]:
        rng = self.rng
        endpoint = rng.choice(["chat", "completions"])
        stream = kind in ("stream", "stream_disconnect") or (kind == "deadline" and rng.random() < 0.5)
        meta = Meta(kind=kind, endpoint=endpoint, stream=stream)
        long_generation = kind in ("stream_disconnect", "nonstream_disconnect", "deadline")
        body = self.base(meta, short_prompt=long_generation)
        if kind == "stream_disconnect":
            # Long enough that the client leaves mid-stream.
            meta.max_tokens = body["max_tokens"] = rng.randint(64, 160)
            meta.ignore_eos = body["ignore_eos"] = True
            body.pop("stop", None)
            meta.disconnect_after_events = rng.randint(1, 6)
        elif kind == "nonstream_disconnect":
            meta.max_tokens = body["max_tokens"] = rng.randint(100, 180)
            meta.ignore_eos = body["ignore_eos"] = True
            body.pop("stop", None)
            meta.client_timeout_s = rng.uniform(0.1, 1.0)
        elif kind == "deadline":
            meta.max_tokens = body["max_tokens"] = rng.randint(120, 180)
            meta.ignore_eos = body["ignore_eos"] = True
            body.pop("stop", None)
            meta.deadline_s = body["request_timeout"] = round(rng.uniform(0.05, 0.5), 3)
        elif kind == "oversized":
            meta.expected_status = 400
            meta.num_prompts, meta.n = 1, 1
            body["n"] = 1
            too_long = self.max_model_len + rng.randint(1, 200)
            if endpoint == "chat":
                body["messages"] = [{"role": "user", "content": self.text(too_long)}]
            elif rng.random() < 0.5:
                body["prompt"] = [rng.randrange(3, 900) for _ in range(too_long)]
            else:
                body["prompt"] = self.text(too_long)
        elif kind == "bad_params":
            name, override, status = rng.choice(BAD_PARAMS)
            meta.kind = f"bad_params:{name}"
            meta.expected_status = status
            if "stream_options" in override:
                body.pop("stream", None)
            body.update(override)
            if rng.random() < 0.1:
                meta.kind, meta.expected_status = "bad_params:malformed JSON", 400
                return meta, json.dumps(body).encode()[:-3] + b"}}{"
        return meta, body

    def burst(self) -> tuple[Meta, dict[str, Any]]:
        meta = Meta(kind="burst", endpoint="completions", stream=False, max_tokens=8, ignore_eos=True)
        body = {"model": self.model, "prompt": self.prompt_text(), "max_tokens": 8, "ignore_eos": True}
        return meta, body


# --------------------------------------------------------------------------- one request


def _path(meta: Meta) -> str:
    return "/v1/chat/completions" if meta.endpoint == "chat" else "/v1/completions"


def _check_choices(outcome: Outcome, meta: Meta, finishes: dict[int, list[str]], errored: bool) -> None:
    expected = meta.num_prompts * meta.n
    bad_index = [i for i in finishes if not 0 <= i < expected]
    if bad_index:
        outcome.problems.append(f"choice indices {bad_index} outside 0..{expected - 1}")
    for i in range(expected):
        reasons = finishes.get(i, [])
        if len(reasons) > 1:
            outcome.problems.append(f"choice {i} finished {len(reasons)} times: {reasons}")
        elif not reasons and not errored:
            outcome.problems.append(f"choice {i} never got a finish_reason")
        outcome.finish_reasons.extend(reasons[:1])
    allowed = {"stop", "length", "abort"}
    odd = [r for r in outcome.finish_reasons if r not in allowed]
    if odd:
        outcome.problems.append(f"unexpected finish_reasons {odd}")
    if meta.ignore_eos and "stop" in outcome.finish_reasons:
        outcome.problems.append("an ignore_eos request without stop strings finished with 'stop'")
    if meta.deadline_s is None and "abort" in outcome.finish_reasons:
        outcome.problems.append("a request nobody aborted finished with 'abort'")


def _check_token_count(outcome: Outcome, meta: Meta) -> None:
    if outcome.completion_tokens is None:  # a stream without include_usage: nothing to count
        return
    if meta.ignore_eos and outcome.finish_reasons and all(r == "length" for r in outcome.finish_reasons):
        outcome.expected_tokens = (meta.max_tokens or 0) * meta.num_prompts * meta.n
        if outcome.completion_tokens != outcome.expected_tokens:
            outcome.problems.append(
                f"ignore_eos: {outcome.completion_tokens} completion tokens, expected {outcome.expected_tokens}"
            )


async def _error_status(outcome: Outcome, meta: Meta, response: httpx.Response) -> None:
    await response.aread()
    outcome.status = response.status_code
    outcome.terminal = "error_status"
    problem = response_error_problem(response)
    if problem:
        outcome.problems.append(problem)
    if response.status_code >= 500:
        outcome.problems.append(f"server error {response.status_code}: {response.text[:300]}")
    elif response.status_code == 429:
        if "retry-after" not in response.headers:
            outcome.problems.append("429 without a Retry-After header")
    elif response.status_code != meta.expected_status:
        outcome.problems.append(
            f"status {response.status_code}, expected {meta.expected_status}: {response.text[:300]}"
        )


async def _stream(client: httpx.AsyncClient, meta: Meta, body: Any, outcome: Outcome) -> None:
    finishes: dict[int, list[str]] = {}
    error_events: list[dict[str, Any]] = []
    num_done = 0
    num_events = 0
    async with client.stream("POST", _path(meta), json=body) as response:
        if response.status_code != 200:
            await _error_status(outcome, meta, response)
            return
        outcome.status = 200
        if meta.expected_status != 200:
            outcome.problems.append(f"status 200, expected {meta.expected_status}")
        async for line in response.aiter_lines():
            if not line:
                continue
            if not line.startswith("data: "):
                outcome.problems.append(f"a stream line that is not an SSE data line: {line[:200]!r}")
                continue
            data = line[len("data: ") :]
            if num_done:
                outcome.problems.append(f"data after [DONE]: {data[:200]!r}")
            if data == "[DONE]":
                num_done += 1
                continue
            num_events += 1
            event = json.loads(data)
            if "error" in event:
                error_events.append(event)
                problem = openai_error_problem(event, event["error"].get("code") or 0)
                if problem:
                    outcome.problems.append(f"error event: {problem}")
            else:
                for choice in event.get("choices", []):
                    if choice.get("finish_reason") is not None:
                        finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
                if event.get("usage"):
                    outcome.completion_tokens = event["usage"]["completion_tokens"]
            if meta.disconnect_after_events and num_events >= meta.disconnect_after_events:
                outcome.terminal = "client_disconnect"
                return  # leaving the block closes the connection mid-stream
    if num_done != 1:
        outcome.problems.append(f"the stream ended with {num_done} [DONE] lines, expected 1")
    _check_choices(outcome, meta, finishes, errored=bool(error_events))
    for event in error_events:
        code = event["error"].get("code")
        if isinstance(code, int) and code >= 500:
            outcome.problems.append(f"server error in the stream: {event['error']}")
        elif meta.deadline_s is None:
            outcome.problems.append(f"an error event nobody caused: {event['error']}")
    if meta.deadline_s is not None and "abort" in outcome.finish_reasons and not error_events:
        outcome.problems.append("a stream that hit its deadline got no error event")
    outcome.terminal = "error_event" if error_events else "completed"
    if meta.include_usage and outcome.completion_tokens is None and not error_events:
        outcome.problems.append("stream_options.include_usage but no usage chunk")
    _check_token_count(outcome, meta)


async def _non_stream(client: httpx.AsyncClient, meta: Meta, body: Any, outcome: Outcome) -> None:
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    if isinstance(body, bytes):
        kwargs["headers"] = {"content-type": "application/json"}
    if meta.client_timeout_s is not None:
        kwargs["timeout"] = httpx.Timeout(meta.client_timeout_s, connect=10.0)
    try:
        response = await client.post(_path(meta), **kwargs)
    except httpx.ReadTimeout:
        if meta.client_timeout_s is None:
            raise
        outcome.terminal = "client_disconnect"
        return
    if response.status_code != 200:
        await _error_status(outcome, meta, response)
        return
    outcome.status = 200
    if meta.expected_status != 200:
        outcome.problems.append(f"status 200, expected {meta.expected_status}")
    result = response.json()
    finishes: dict[int, list[str]] = {}
    for choice in result["choices"]:
        finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    outcome.completion_tokens = result["usage"]["completion_tokens"]
    _check_choices(outcome, meta, finishes, errored=False)
    outcome.terminal = "completed"
    _check_token_count(outcome, meta)


async def run_one(client: httpx.AsyncClient, meta: Meta, body: Any, config: SoakConfig) -> Outcome:
    outcome = Outcome(meta.kind, meta.endpoint, meta.stream, meta.num_prompts * meta.n)
    started = time.monotonic()
    try:
        async with asyncio.timeout(config.request_timeout_s):
            if meta.stream:
                await _stream(client, meta, body, outcome)
            else:
                await _non_stream(client, meta, body, outcome)
    except TimeoutError:
        outcome.problems.append(f"no terminal outcome within {config.request_timeout_s:.0f} s (a hang)")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        outcome.problems.append(f"client-side failure nobody caused: {type(exc).__name__}: {exc}")
    outcome.latency_s = time.monotonic() - started
    if outcome.problems:
        outcome.terminal = "violation"
    return outcome


# --------------------------------------------------------------------------- the whole soak

ENGINE_COUNTERS = ("num_preemptions_total", "prefix_cache_hits_total", "generation_tokens_total")


def engine_counters(base_url: str) -> dict[str, float]:
    return {name: metric(base_url, name) for name in ENGINE_COUNTERS}


@dataclass
class SoakReport:
    duration_s: float
    num_requests: int
    outcomes_by_kind: dict[str, dict[str, int]]
    statuses: dict[str, int]
    num_429: int
    finish_reasons: dict[str, int]
    completion_tokens: int
    ignore_eos_exact: (
        int  # ignore_eos requests that completed, each checked for exactly max_tokens per choice
    )
    admitted_sequences_known: int
    admitted_sequences_unknown: int  # non-streaming requests this script gave up on
    server_finished_sequences: int
    server_finished_by_reason: dict[str, float]
    engine_counters: dict[str, float]  # what the load made the engine do (deltas over the soak)
    idle_after_drain: dict[str, float] | None
    engine_invariants: str  # "ok", or what the engine's check (GET /debug/invariants) said
    violations: list[str]

    def summary(self) -> str:
        lines = [
            f"soak: {self.num_requests} requests in {self.duration_s:.0f} s "
            f"({self.num_requests / max(self.duration_s, 1e-9):.1f} req/s), "
            f"{self.completion_tokens} completion tokens; {self.ignore_eos_exact} ignore_eos completions "
            "checked for exactly max_tokens",
            f"  statuses: {self.statuses}  (429: {self.num_429})",
            f"  finish reasons: {self.finish_reasons}",
            f"  admitted sequences: {self.admitted_sequences_known} known + up to "
            f"{self.admitted_sequences_unknown} given up on; the server finished {self.server_finished_sequences} "
            f"{self.server_finished_by_reason}",
            f"  engine: {self.engine_counters}",
            f"  after the drain: {self.idle_after_drain}",
            f"  engine invariants after the drain: {self.engine_invariants}",
        ]
        for kind, terminals in sorted(self.outcomes_by_kind.items()):
            lines.append(f"  {kind:<44} {dict(sorted(terminals.items()))}")
        lines.append(f"  violations: {len(self.violations)}")
        lines.extend(f"    {v}" for v in self.violations[:30])
        return "\n".join(lines)


def _pick_kind(rng: random.Random, config: SoakConfig) -> str:
    kinds = {
        "stream": config.weight_stream,
        "nonstream": config.weight_nonstream,
        "stream_disconnect": config.weight_stream_disconnect,
        "nonstream_disconnect": config.weight_nonstream_disconnect,
        "deadline": config.weight_deadline,
        "oversized": config.weight_oversized,
        "bad_params": config.weight_bad_params,
    }
    return rng.choices(list(kinds), weights=list(kinds.values()))[0]


async def run_soak(base_url: str, config: SoakConfig) -> SoakReport:
    limits = httpx.Limits(max_connections=config.concurrency + config.burst_size + 8)
    timeout = httpx.Timeout(config.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model, max_model_len = models[0]["id"], models[0]["max_model_len"]
        before = await asyncio.to_thread(finished_by_reason, base_url)
        counters_before = await asyncio.to_thread(engine_counters, base_url)
        outcomes: list[Outcome] = []
        started = time.monotonic()
        stop_at = started + config.duration_s

        async def worker(index: int) -> None:
            rng = random.Random(config.seed * 1000 + index)
            factory = RequestFactory(rng, model, max_model_len, config)
            while time.monotonic() < stop_at:
                meta, body = factory.make(_pick_kind(rng, config))
                outcomes.append(await run_one(client, meta, body, config))

        async def bursts() -> None:
            rng = random.Random(config.seed * 1000 - 1)
            factory = RequestFactory(rng, model, max_model_len, config)
            while time.monotonic() + config.burst_every_s < stop_at:
                await asyncio.sleep(config.burst_every_s)
                batch = [factory.burst() for _ in range(config.burst_size)]
                outcomes.extend(await asyncio.gather(*(run_one(client, m, b, config) for m, b in batch)))

        tasks = [worker(i) for i in range(config.concurrency)]
        if config.burst_every_s > 0 and config.burst_size > 0:
            tasks.append(bursts())
        await asyncio.gather(*tasks)
        duration = time.monotonic() - started

    violations = [f"{o.kind} ({o.endpoint}, stream={o.stream}): {p}" for o in outcomes for p in o.problems]
    idle = None
    try:
        idle = await asyncio.to_thread(wait_idle, base_url, 30.0)
    except AssertionError as exc:
        violations.append(str(exc))
    invariants = await asyncio.to_thread(engine_invariants, base_url)
    if invariants != "ok" and not invariants.startswith("not checked"):
        violations.append(f"engine invariants after the drain: {invariants}")
    after = await asyncio.to_thread(finished_by_reason, base_url)
    counters_after = await asyncio.to_thread(engine_counters, base_url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    known = sum(o.num_sequences for o in outcomes if o.status == 200)
    unknown = sum(o.num_sequences for o in outcomes if o.status is None and o.terminal == "client_disconnect")
    server_finished = int(sum(delta.values()))
    if not known <= server_finished <= known + unknown:
        violations.append(
            f"the server finished {server_finished} sequences; the clients saw {known} admitted "
            f"(+ up to {unknown} they gave up on): a sequence was lost or finished twice"
        )
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.terminal] += 1
    return SoakReport(
        duration_s=duration,
        num_requests=len(outcomes),
        outcomes_by_kind={k: dict(v) for k, v in by_kind.items()},
        statuses=dict(Counter(str(o.status) for o in outcomes)),
        num_429=sum(o.status == 429 for o in outcomes),
        finish_reasons=dict(Counter(r for o in outcomes for r in o.finish_reasons)),
        completion_tokens=sum(o.completion_tokens or 0 for o in outcomes),
        ignore_eos_exact=sum(o.expected_tokens is not None and not o.problems for o in outcomes),
        admitted_sequences_known=known,
        admitted_sequences_unknown=unknown,
        server_finished_sequences=server_finished,
        server_finished_by_reason=delta,
        engine_counters={k: counters_after[k] - counters_before[k] for k in counters_after},
        idle_after_drain=idle,
        engine_invariants=invariants,
        violations=violations,
    )


# --------------------------------------------------------------------------- the script


def _tiny_model(directory: Path) -> Path:
    from tests.conftest import TINY_LLAMA_ROPE_SCALING, build_tiny_tokenizer, write_tiny_checkpoint

    rope = dict(TINY_LLAMA_ROPE_SCALING)
    return write_tiny_checkpoint(
        directory,
        "llama",
        build_tiny_tokenizer(),
        seed=1,
        tie_word_embeddings=True,
        head_dim=16,
        rope_parameters=rope,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.reliability.soak", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--base-url", default=None, help="soak this server instead of starting one")
    parser.add_argument(
        "--model", default=None, help="model for the started server (default: a tiny random Llama)"
    )
    parser.add_argument(
        "--server-args",
        default=" ".join(DEFAULT_SERVER_ARGS),
        help="extra `tokenmill serve` flags for the started server (one string)",
    )
    defaults = SoakConfig()
    parser.add_argument("--duration", type=float, default=defaults.duration_s, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="clients in a loop")
    parser.add_argument(
        "--burst-every", type=float, default=defaults.burst_every_s, help="s between bursts; 0: none"
    )
    parser.add_argument("--burst-size", type=int, default=defaults.burst_size)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="of ordinary requests")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    for kind in (
        "stream",
        "nonstream",
        "stream_disconnect",
        "nonstream_disconnect",
        "deadline",
        "oversized",
        "bad_params",
    ):
        flag = kind.replace("_", "-")
        parser.add_argument(f"--weight-{flag}", type=float, default=getattr(defaults, f"weight_{kind}"))
    parser.add_argument("--json-out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    config = SoakConfig(
        duration_s=args.duration,
        concurrency=args.concurrency,
        burst_every_s=args.burst_every,
        burst_size=args.burst_size,
        max_tokens=args.max_tokens,
        seed=args.seed,
        **{f"weight_{k}": getattr(args, f"weight_{k}") for k in (
            "stream", "nonstream", "stream_disconnect", "nonstream_disconnect", "deadline", "oversized", "bad_params"
        )},
    )  # fmt: skip

    if args.base_url:
        report = asyncio.run(run_soak(args.base_url, config))
        return _finish(report, args.json_out, leaked=None)

    from tests.reliability.server_tools import start_tiny_server

    with tempfile.TemporaryDirectory(prefix="tokenmill-soak-") as tmp:
        model = args.model or str(_tiny_model(Path(tmp) / "tiny_llama"))
        print(f"starting tokenmill serve --model {model} {args.server_args}", file=sys.stderr)
        server = start_tiny_server(tmp, model, *args.server_args.split())
        tree = process_tree(server.process.pid)
        try:
            report = asyncio.run(run_soak(server.base_url, config))
        finally:
            code = server.stop(signal.SIGTERM, timeout=60)
        leaked = survivors(tree)
        if code != 0:
            report.violations.append(f"the server exited with {code} after SIGTERM:\n{server.log()}")
        return _finish(report, args.json_out, leaked=leaked)


def _finish(report: SoakReport, json_out: str | None, leaked: list[str] | None) -> int:
    if leaked:
        report.violations.append(f"processes outlived the server: {leaked}")
    print(report.summary())
    if leaked is not None:
        print(f"  processes left after SIGTERM: {len(leaked)}")
    if json_out:
        with contextlib.suppress(OSError):
            Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(asdict(report), indent=2))
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
