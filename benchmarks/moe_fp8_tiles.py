"""FP8 expert weights in the few-token MoE GEMVs: which tiles, against bf16 weights, Qwen3-30B-A3B shapes.

One MoE layer's routed experts (128 experts, hidden 2048, intermediate 768, top-8) at 1-8 tokens
through `routed_fused_moe` (routing inside the gate/up launch, as a decode step runs it), replayed
from a CUDA graph: bf16 weights with their tuned tiles, and e4m3 weights with per-row scales (what
`--quantization fp8` makes) under candidate GEMV tiles. The e4m3 weights are half the bytes, so a
tile the bf16 tuner chose for 2-byte loads moves half as much per load; the candidates scale
BLOCK_K (and BLOCK_N) up. Prints us per call and the bytes of weights read per second; writes
benchmarks/results/moe-fp8-tiles-*.json.

    PYTHONPATH=src python3 benchmarks/moe_fp8_tiles.py
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8


def _graph_time_us(fn, replays: int = 200) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays // 10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    return sorted(times)[len(times) // 2]


def main() -> None:
    from tokenmill.bench.results import write_result
    from tokenmill.kernels.triton.fused_moe import routed_fused_moe
    from tokenmill.kernels.triton.moe_tile_configs import GemmTiles, MoETiles, moe_tiles
    from tokenmill.model.layers.quantize_weights import quantize_fp8_per_channel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-name", default="moe-fp8-tiles")
    args = parser.parse_args()
    torch.manual_seed(0)
    w13 = torch.randn((EXPERTS, 2 * INTER, HIDDEN), device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn((EXPERTS, HIDDEN, INTER), device="cuda", dtype=torch.bfloat16) * 0.02
    q13, s13, _ = quantize_fp8_per_channel(w13.flatten(0, 1))
    q2, s2, _ = quantize_fp8_per_channel(w2.flatten(0, 1))
    q13, s13 = q13.view(w13.shape), s13.view(EXPERTS, 2 * INTER)
    q2, s2 = q2.view(w2.shape), s2.view(EXPERTS, HIDDEN)
    fp8 = {"w13_scale": s13, "w2_scale": s2, "scale_block": None}
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn((tokens, HIDDEN), device="cuda", dtype=torch.bfloat16)
        logits = torch.randn((tokens, EXPERTS), device="cuda", dtype=torch.bfloat16)
        tuned = moe_tiles(EXPERTS, INTER, HIDDEN, torch.bfloat16, tokens, TOP_K)
        if tuned.method != "gemv":
            continue
        bytes_read = tokens * TOP_K * 3 * INTER * HIDDEN  # e4m3; at most, if no two tokens share an expert

        def call(w_a, w_b, tiles, extra, x=x, logits=logits):
            return lambda: routed_fused_moe(x, logits, w_a, w_b, TOP_K, True, True, tiles, **extra)

        bf16_us = _graph_time_us(call(w13, w2, tuned, {}))
        rows.append({"tokens": tokens, "weights": "bf16", "tiles": "tuned", "us": bf16_us,
                     "bytes_per_s": 2 * bytes_read / bf16_us * 1e6})  # fmt: skip
        print(f"{tokens} tokens  bf16 tuned tiles: {bf16_us:7.2f} us ({2 * bytes_read / bf16_us / 1e6:.2f} TB/s)")
        gate_up, down = tuned.gate_up, tuned.down
        for k_scale in (1, 2, 4):
            for n_scale in (1, 2):
                g = GemmTiles(block_n=gate_up.block_n * n_scale, block_k=gate_up.block_k * k_scale,
                              num_warps=gate_up.num_warps, num_stages=gate_up.num_stages)  # fmt: skip
                d = GemmTiles(block_n=down.block_n * n_scale, block_k=min(INTER, down.block_k * k_scale),
                              num_warps=down.num_warps, num_stages=down.num_stages)  # fmt: skip
                tiles = MoETiles(tuned.block_m, g, d, "gemv")
                try:
                    us = _graph_time_us(call(q13, q2, tiles, fp8))
                except Exception as err:  # a tile Triton cannot compile (shared memory): record it
                    print(f"  block_k x{k_scale} block_n x{n_scale}: failed ({type(err).__name__})")
                    continue
                rows.append({"tokens": tokens, "weights": "fp8", "gate_up": asdict(g), "down": asdict(d),
                             "block_k_scale": k_scale, "block_n_scale": n_scale, "us": us,
                             "bytes_per_s": bytes_read / us * 1e6, "vs_bf16": bf16_us / us})  # fmt: skip
                print(f"  fp8 block_k x{k_scale} block_n x{n_scale}: {us:7.2f} us "
                      f"({bytes_read / us / 1e6:.2f} TB/s, {bf16_us / us:.2f}x bf16)")  # fmt: skip
    config = {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTER, "top_k": TOP_K, "scales": "per row"}
    print(f"wrote {write_result('moe-fp8-tiles', config, {'rows': rows}, args.result_dir, args.result_name)}")


if __name__ == "__main__":
    main()
