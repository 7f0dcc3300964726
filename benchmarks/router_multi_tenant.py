"""The cache-aware router against round robin on a multi-tenant workload (CPU, default model).

    PYTHONPATH=src python benchmarks/router_multi_tenant.py --num-prompts 96 --kv-cache-memory 160MiB

For each policy, in the same run and on the same prompts (same seed): two fresh replicas
(`tokenmill serve`, a small KV pool so that one replica cannot hold every tenant's system prompt),
`tokenmill router --policy P` in front of them, and `tokenmill bench serve --dataset-name
multi-tenant` through the router (16 tenants' system prompts of 400-800 tokens, many users each).
Records the replicas' prefix-cache hit rate (their tokenmill:prefix_cache_hits / queries gained during
the run), TTFT p50 / p99 and throughput per policy, and the ratios, in benchmarks/results/. Fresh
replicas per policy: no policy inherits the other's cache. Run from the repo root.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from tokenmill.bench import serve as bench_serve
from tokenmill.bench.prometheus_text import parse_samples
from tokenmill.bench.results import write_result

KEPT_METRICS = (
    "completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_e2el_ms", "p99_e2el_ms",
)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen([sys.executable, "-m", "tokenmill.cli", *argv], stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, log_path: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not healthy after {timeout_s:.0f} s; see {log_path}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def prefix_cache_totals(url: str) -> tuple[float, float]:
    samples = parse_samples(httpx.get(f"{url}/metrics", timeout=10).text)

    def total(name: str) -> float:
        return sum(value for _, value in samples.get(f"tokenmill:{name}", []))

    return total("prefix_cache_queries_total"), total("prefix_cache_hits_total")


def bench_args(args: argparse.Namespace, router_url: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    return parser.parse_args([
        "--base-url", router_url, "--endpoint", "/v1/completions", "--dataset-name", "multi-tenant",
        "--num-prompts", str(args.num_prompts), "--multi-tenant-num-tenants", str(args.num_tenants),
        "--multi-tenant-system-len", args.system_len, "--multi-tenant-user-len", str(args.user_len),
        "--multi-tenant-output-len", str(args.output_len), "--request-rate", str(args.request_rate),
        "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", str(args.seed),
        "--disable-tqdm", "--metric-percentiles", "50,99",
    ])  # fmt: skip


def run_policy(policy: str, args: argparse.Namespace, log_dir: str) -> dict:
    replicas, processes = [], []
    try:
        for i in range(2):
            port = free_port()
            log = os.path.join(log_dir, f"{policy}-replica{i}.log")
            processes.append(spawn([
                "serve", "--device", "cpu", "--port", str(port), "--kv-cache-memory", args.kv_cache_memory,
                "--max-model-len", "2048", "--disable-uvicorn-access-log",
            ], log))  # fmt: skip
            replicas.append((f"http://127.0.0.1:{port}", processes[-1], log))
        for url, process, log in replicas:
            wait_healthy(url, process, 600, log)
            # One short request each, outside the measurement: first-call warm-ups of the kernels.
            httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=300)
        router_port = free_port()
        router_log = os.path.join(log_dir, f"{policy}-router.log")
        router = spawn(
            ["router", "--port", str(router_port), "--policy", policy, *sum((["--replica", u] for u, _, _ in replicas), [])],
            router_log,
        )  # fmt: skip
        processes.append(router)
        router_url = f"http://127.0.0.1:{router_port}"
        wait_healthy(router_url, router, 60, router_log)
        before = [prefix_cache_totals(url) for url, _, _ in replicas]
        print(f"== {policy}: {args.num_prompts} requests through {router_url}", flush=True)
        runs = asyncio.run(bench_serve.run_benchmark(bench_args(args, router_url)))
        after = [prefix_cache_totals(url) for url, _, _ in replicas]
        queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
        hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
        metrics = {k: runs[0].metrics.get(k) for k in KEPT_METRICS}
        per_replica = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
        metrics |= {
            "prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": hits / queries if queries else 0.0,
            "prefix_cache_queries_per_replica": per_replica,
            "router_metrics": {
                line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
                for line in httpx.get(f"{router_url}/metrics", timeout=10).text.splitlines()
                if line.startswith("tokenmill_router:") and "_created" not in line
                and ("_total" in line or "affinity" in line)
            },
        }  # fmt: skip
        print(f"   prefix-cache hit rate {metrics['prefix_cache_hit_rate']:.3f}, TTFT p50 "
              f"{metrics['median_ttft_ms']:.0f} ms p99 {metrics['p99_ttft_ms']:.0f} ms, "
              f"{metrics['output_throughput']:.1f} output tok/s", flush=True)  # fmt: skip
        return metrics
    finally:
        for process in reversed(processes):
            stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--num-tenants", type=int, default=16)
    parser.add_argument("--system-len", default="400,800", help="MIN,MAX tokens of a tenant's system prompt")
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="160MiB", help="each replica's KV pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="round_robin,cache_aware")
    parser.add_argument("--result-name", default=None)
    args = parser.parse_args()
    log_dir = tempfile.mkdtemp(prefix="router-bench-")
    print(f"logs in {log_dir}", flush=True)
    results = {policy: run_policy(policy, args, log_dir) for policy in args.policies.split(",")}
    summary: dict = {"per_policy": results}
    if {"round_robin", "cache_aware"} <= results.keys():
        rr, ca = results["round_robin"], results["cache_aware"]
        summary["hit_rate_ratio"] = ca["prefix_cache_hit_rate"] / rr["prefix_cache_hit_rate"] if rr["prefix_cache_hit_rate"] else None
        summary["ttft_p50_ratio"] = ca["median_ttft_ms"] / rr["median_ttft_ms"]
        summary["ttft_p99_ratio"] = ca["p99_ttft_ms"] / rr["p99_ttft_ms"]
        summary["throughput_ratio"] = ca["output_throughput"] / rr["output_throughput"]
        print({k: v for k, v in summary.items() if k != "per_policy"})
    config = {k: getattr(args, k) for k in vars(args)}
    config |= {"replicas": 2, "model": "default (SmolLM2-135M-Instruct Q4_1)", "endpoint": "/v1/completions"}
    path = write_result("router", config, summary, name=args.result_name)
    print(f"Saved {path}")


if __name__ == "__main__":
    main()
