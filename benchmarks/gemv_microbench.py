"""Batch-1 decode matmuls of Llama-3.1-8B: cuBLAS (F.linear) against the Triton weight-streaming kernel.

Each shape is timed as one CUDA graph of 32 matmuls over 32 distinct weight matrices (one per
layer, as a decode step reads them), so the L2 cache holds none of them and launch gaps are those
of a graph replay. Rates count the weight bytes read; the fraction is against a device-to-device
copy's bandwidth (bytes read + written), the roofline of `tokenmill bench latency`.

    PYTHONPATH=src python benchmarks/gemv_microbench.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.bench.latency import copy_bandwidth
from tokenmill.model.layers.triton_gemv import GemvConfig, skinny_linear

SHAPES = {  # name: (N, K, copies)
    "qkv": (6144, 4096, 32),
    "o_proj": (4096, 4096, 32),
    "gate_up": (28672, 4096, 32),
    "down": (4096, 14336, 32),
    "lm_head": (128256, 4096, 2),
}
CONFIGS = [
    GemvConfig(16, 512, 4, 4),
    GemvConfig(16, 256, 4, 4),
    GemvConfig(32, 256, 4, 4),
    GemvConfig(32, 512, 8, 4),
    GemvConfig(16, 1024, 8, 3),
    GemvConfig(64, 128, 4, 4),
    GemvConfig(8, 1024, 4, 4),
    GemvConfig(16, 512, 4, 4, use_dot=True),
]


def graph_ms(calls) -> float:
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 10


def main() -> None:
    bandwidth = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    totals = {"cublas": 0.0, "triton_best": 0.0}
    total_bytes = 0
    best_configs = {}
    for name, (n, k, copies) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        nbytes = copies * n * k * 2
        reference = F.linear(x, weights[0]).float()
        results = {"cublas": graph_ms([lambda w=w, x=x: F.linear(x, w) for w in weights])}
        for config in CONFIGS:
            out = skinny_linear(x, weights[0], config=config).float()
            err = ((out - reference).norm() / reference.norm()).item()
            if err > 1e-2:
                print(f"  {name} {config}: relative error {err:.2e}, skipped")
                continue
            results[str(config)] = graph_ms(
                [lambda w=w, c=config, x=x: skinny_linear(x, w, config=c) for w in weights]
            )
        best = min((key for key in results if key != "cublas"), key=results.get)
        best_configs[name] = best
        scale = (32 / copies) if name != "lm_head" else 1 / copies  # per decode step: 32 layers, 1 lm_head
        totals["cublas"] += results["cublas"] * scale
        totals["triton_best"] += results[best] * scale
        total_bytes += nbytes * scale
        for key, ms in sorted(results.items(), key=lambda kv: kv[1]):
            rate = nbytes / (ms / 1000)
            print(
                f"  {name:8s} {ms * 1000 / copies:8.1f} us/matmul  {rate / 1e9:7.0f} GB/s  "
                f"{rate / bandwidth:5.3f} of copy  {key}"
            )
        del weights
        torch.cuda.empty_cache()
    for key, ms in totals.items():
        rate = total_bytes / (ms / 1000)
        print(
            f"one decode step's matmuls, {key}: {ms:.3f} ms, {rate / 1e9:.0f} GB/s, {rate / bandwidth:.3f} of copy"
        )
    print("best Triton config per shape:", best_configs)


if __name__ == "__main__":
    main()
