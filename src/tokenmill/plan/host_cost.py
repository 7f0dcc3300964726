"""The serving host's share of the time to first token: what the API server (and the streaming client
reading it) add to the engine's TTFT, which the roofline model (roofline.py) does not see.

Per request, `bench serve`'s traces (bench/tail.py) split the client's TTFT into stages; three of them
are host CPU, not GPU: `api_in` (HTTP and tokenization, waiting for a busy event loop),
`engine_to_api` (the API server takes the step's outputs off its socket) and `api_to_client` (the
step's outputs are detokenized, formatted as SSE chunks and written, then read by the client). Each
engine step hands the API server one output per running stream, and single-threaded event loops
(the API server's, the client's) work through them in turn. A new stream's first token comes last
in its step's outputs (the scheduler fills a batch with the running requests first, then the
admitted ones, core/scheduler.py), so the API server detokenizes and delivers the C others first,
and its handler is woken last: the host's share grows with the concurrency C. In the
H100 traces at `0c78bdb` it does: 15.3, 27.1, 46.1 ms (sums of the three stages' medians) at C = 37,
72, 142 (16, 24, 32 req/s); the engine's own stages (to_engine, queued, prefill) are what the
roofline model's TTFT predicts (tests/unit/test_planner.py checks both shares against the traces).

The model: host share = per_stream_s x C, with per_stream_s fitted on one traced run (fit_host_cost):
its three stages' medians over its Little's-law concurrency. The cost is the host's CPU, not the GPU's;
only one host kind of ours (the H100 machine) is calibrated, and the plan says so for the others.

Caveat (2026-12-05): the calibration run served dummy weights with SmolLM2's 49,152-id tokenizer on
a 128,256-id model, so 62 % of sampled ids had no text and `api_to_client`, timed to the first chunk
with text, holds about one decode step (one TPOT) at the median besides the host's work. Measured
since on the CPU with the same script and tokenizers (BENCHMARKS.md, "the benchmark tokenizer's share
of served TTFT and ITL"): `api_to_client` median 13.7 ms with that tokenizer against 1.6 ms with one
of the model's size, at a 12 ms TPOT. The H100 fit's 12.0 ms of `api_to_client` is therefore mostly
that wait, and per_stream_s is likely ~3x too high (~0.13 ms from its other stages) until it is
refitted on a GPU run with a full-vocabulary tokenizer (the serving scripts' default now).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

HOST_STAGES = ("api_in", "engine_to_api", "api_to_client")  # bench/tail.py's TTFT_STAGES that are host CPU
ENGINE_STAGES = ("to_engine", "queued", "prefill")  # the engine's: what the roofline model's TTFT covers


@dataclass(frozen=True, slots=True)
class HostCost:
    per_stream_s: float  # TTFT the API server and client add per stream in flight
    source: str


def littles_law_concurrency(metrics: dict) -> int:
    """A `bench serve` run's mean requests in flight: completed req/s x mean end-to-end latency."""
    return round(metrics["request_throughput"] * metrics["mean_e2el_ms"] / 1000)


def stage_sum_ms(metrics: dict, stages: tuple[str, ...]) -> float:
    """The sum of `stages`' medians in a traced run's TTFT breakdown (metrics.tail)."""
    p50 = metrics["tail"]["ttft_stage_ms_p50_all"]
    return sum(p50[s] for s in stages)


def fit_host_cost(serve_file: Path) -> float:
    """per_stream_s from a traced `bench serve` run: its host stages' medians over its concurrency."""
    metrics = json.loads(serve_file.read_text())["metrics"]
    return stage_sum_ms(metrics, HOST_STAGES) / 1000 / littles_law_concurrency(metrics)


# Fitted by fit_host_cost() (a test checks the two agree). Per machine: add a GPU's machine with a
# traced `bench serve` run of its own (benchmarks/serve_tail_sweep.sh at a low rate).
HOST_COSTS: dict[str, HostCost] = {
    "H100": HostCost(
        per_stream_s=0.4122e-3,
        source="the H100 machine's, fitted on serve-tail-llama-3.1-8b-h100-rate-16-0c78bdb.json (api_in + "
        "engine_to_api + api_to_client medians 2.8 + 0.5 + 12.0 ms at 37 streams in flight)",
    ),
}
HOST_COST = HOST_COSTS["H100"]


def host_cost_for(gpu_name: str) -> HostCost:
    """The machine's fitted host cost, else the H100 machine's, saying so."""
    known = HOST_COSTS.get(gpu_name)
    if known is not None:
        return known
    return HostCost(HOST_COST.per_stream_s, f"no traced serving run on a {gpu_name} machine; borrowed: {HOST_COST.source}")
