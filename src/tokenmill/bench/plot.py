"""PNG charts of `bench serve` runs: latency CDFs, and throughput / TTFT against concurrency."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

from tokenmill.bench.serve_metrics import LATENCY_METRICS, LATENCY_TITLES, ServeRun


def plot_serve_runs(runs: list[ServeRun], path: str | Path, title: str = "") -> Path:
    """Latency CDFs (one line per run); with several concurrencies, a row of sweep charts too."""
    sweep = [r for r in runs if r.max_concurrency is not None]
    show_sweep = len(sweep) > 1
    nrows = 3 if show_sweep else 2
    fig = Figure(figsize=(12, 4 * nrows), layout="constrained")
    axes = fig.subplots(nrows, 2)
    for ax, name in zip(axes[:2].flat, LATENCY_METRICS, strict=True):
        for run in runs:
            values = np.sort(np.asarray(run.samples.get(name, []), dtype=np.float64) * 1000.0)
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=run.label)
        ax.set_title(f"{LATENCY_TITLES[name]} ({name.upper()})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples ≤ x")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize="small")
    if show_sweep:
        sweep.sort(key=lambda r: r.max_concurrency)
        conc = [r.max_concurrency for r in sweep]
        ax = axes[2][0]
        ax.plot(conc, [r.metrics["output_throughput"] for r in sweep], marker="o", label="output tok/s")
        ax.plot(conc, [r.metrics["total_token_throughput"] for r in sweep], marker="s", label="total tok/s")
        ax.set_title("Throughput against concurrency")
        ax.set_ylabel("tokens / s")
        ax = axes[2][1]
        ax.plot(conc, [r.metrics["mean_ttft_ms"] for r in sweep], marker="o", label="mean TTFT")
        ax.plot(conc, [r.metrics["median_ttft_ms"] for r in sweep], marker="^", label="median TTFT")
        p_keys = [k for k in sweep[0].metrics if k.startswith("p") and k.endswith("_ttft_ms")]
        for key in p_keys:
            ax.plot(conc, [r.metrics[key] for r in sweep], marker="s", label=f"{key.split('_')[0]} TTFT")
        ax.set_title("TTFT against concurrency")
        ax.set_ylabel("ms")
        for ax in axes[2]:
            ax.set_xscale("log", base=2)
            ax.set_xticks(conc, [str(c) for c in conc])
            ax.set_xlabel("max concurrency")
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
