"""What `bench serve` reports, computed as `vllm bench serve` does, with its JSON key names.

TTFT: request sent to first content chunk. TPOT: (E2EL - TTFT) / (output tokens - 1), one value
per request with more than one token. ITL: gaps between consecutive content chunks, pooled over
all requests. E2EL: request sent to end of stream. Goodput: requests per second that met every
given SLO (in ms).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
LATENCY_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass(slots=True)
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    latency: float = 0.0  # seconds, request sent to end of stream
    start_time: float = 0.0  # perf_counter when sent
    # time.monotonic() when sent (the server's trace uses that clock) and the response's "id": how
    # bench/tail.py finds the request in the server's trace.
    sent_monotonic: float = 0.0
    response_id: str | None = None
    error: str = ""
    # What was generated and why it ended: the structured-output workload validates the text.
    generated_text: str = ""
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class ServeRun:
    """One run of the benchmark at one concurrency cap."""

    max_concurrency: int | None  # None: unbounded
    metrics: dict
    samples: dict[str, list[float]]  # seconds, per latency metric (see latency_samples)

    @property
    def label(self) -> str:
        return f"concurrency {'inf' if self.max_concurrency is None else self.max_concurrency}"


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    """ "ttft:500 tpot:50" (one string or several) -> {"ttft": 500.0, "tpot": 50.0} in ms."""
    slos: dict[str, float] = {}
    for spec in specs or []:
        for item in spec.replace(",", " ").split():
            key, sep, value = item.partition(":")
            if not sep or key not in GOODPUT_METRICS:
                raise ValueError(
                    f"bad --goodput item {item!r}: expected KEY:MS with KEY one of {', '.join(GOODPUT_METRICS)}"
                )
            try:
                ms = float(value)
            except ValueError as exc:
                raise ValueError(f"bad --goodput value in {item!r}: {value!r} is not a number") from exc
            if ms <= 0:
                raise ValueError(f"bad --goodput value in {item!r}: must be > 0 ms")
            slos[key] = ms
    return slos


def _meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": r.ttft * 1000, "tpot": (r.tpot or 0.0) * 1000, "e2el": r.latency * 1000}
    return all(values_ms[k] <= limit for k, limit in slos.items())


def _summary(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    out = {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
    }
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def latency_samples(results: list[RequestResult]) -> dict[str, list[float]]:
    """Per-metric samples in seconds over the successful requests (for summaries and plots)."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def compute_metrics(
    results: list[RequestResult],
    duration: float,
    goodput_slos: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = (99.0,),
) -> dict[str, float | int | None]:
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    duration = max(duration, 1e-9)
    metrics: dict[str, float | int | None] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": (
            sum(_meets_slos(r, goodput_slos) for r in ok) / duration if goodput_slos else None
        ),
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in latency_samples(results).items():
        metrics.update(_summary(name, values, sorted(set(percentiles))))
    return metrics


def format_report(metrics: dict, max_concurrency: int | None, request_rate: float) -> str:
    """A table in the layout of `vllm bench serve`."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: object, fmt: str = "") -> None:
        lines.append(f"{label:<40}{value:>10{fmt}}")

    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Maximum request concurrency:", "inf" if max_concurrency is None else max_concurrency)
    row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", metrics["duration"], ".2f")
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"], ".2f")
    if metrics.get("request_goodput") is not None:
        row("Request goodput (req/s):", metrics["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", metrics["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", metrics["total_token_throughput"], ".2f")
    for name in LATENCY_METRICS:
        lines.append("{s:{c}^50}".format(s=f" {LATENCY_TITLES[name]} ", c="-")[:50])
        upper = name.upper()
        row(f"Mean {upper} (ms):", metrics[f"mean_{name}_ms"], ".2f")
        row(f"Median {upper} (ms):", metrics[f"median_{name}_ms"], ".2f")
        for key, value in metrics.items():
            if key.startswith("p") and key.endswith(f"_{name}_ms"):
                row(f"{key.split('_')[0].upper()} {upper} (ms):", value, ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
