"""FP8 or INT4 expert weights in the few-token MoE GEMVs: which tiles, against bf16 weights, Qwen3-30B-A3B shapes.

One MoE layer's routed experts (128 experts, hidden 2048, intermediate 768, top-8) at 1-8 tokens
through `routed_fused_moe` (routing inside the gate/up launch, as a decode step runs it), replayed
from a CUDA graph: bf16 weights with their tuned tiles, and e4m3 weights with per-row scales (what
`--quantization fp8` makes) under candidate GEMV tiles. The e4m3 weights are half the bytes, so a
tile the bf16 tuner chose for 2-byte loads moves half as much per load; the candidates scale
BLOCK_K (and BLOCK_N) up. With `--weights int4`: 4-bit weights in groups of 128 (what
`--quantization awq` makes; a quarter of the bytes plus the scales), whose GEMVs walk packs of 256
columns: the candidates are gate/up and down BLOCK_N, warps and BLOCK_K / 256 packs an iteration. Prints us
per call and the bytes of weights read per second; writes benchmarks/results/moe-<weights>-tiles-*.json.

`--weights int4 --grouped` times the grouped GEMMs instead (batches the tuned tiles send there,
16-4096 tokens; prefill): bf16 at its tuned tiles against INT4 at the same tiles with the nibble-plane
path's stage rule (fused_moe.int4_plane_stages), the per-weight gather path at its tiles, and the
plane path at each of 1-4 stages with the rule bypassed, which shows where the shared memory runs out
(a failed launch is recorded, not fatal).

    PYTHONPATH=src python3 benchmarks/moe_fp8_tiles.py [--weights int4 [--grouped --tokens 64,512,4096]]
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
    from tokenmill.kernels.triton.moe_tile_configs import MoETiles, moe_tiles
    from tokenmill.model.layers.quantize_weights import quantize_fp8_per_channel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--weights", choices=("fp8", "int4"), default="fp8")
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-name", default=None)
    parser.add_argument(
        "--grouped", action="store_true", help="INT4 only: the grouped GEMMs (prefill batches)"
    )
    args = parser.parse_args()
    if args.grouped and args.weights != "int4":
        parser.error("--grouped times INT4 experts: pass --weights int4")
    torch.manual_seed(0)
    w13 = torch.randn((EXPERTS, 2 * INTER, HIDDEN), device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn((EXPERTS, HIDDEN, INTER), device="cuda", dtype=torch.bfloat16) * 0.02
    if args.weights == "int4":
        q13, q2, quantized = _int4_experts(w13, w2)
        bytes_per_weight = 0.5 + (4 + 1) / INT4_GROUP  # the nibble, a float32 scale and a zero per group
    else:
        q13, s13, _ = quantize_fp8_per_channel(w13.flatten(0, 1))
        q2, s2, _ = quantize_fp8_per_channel(w2.flatten(0, 1))
        q13, s13 = q13.view(w13.shape), s13.view(EXPERTS, 2 * INTER)
        q2, s2 = q2.view(w2.shape), s2.view(EXPERTS, HIDDEN)
        quantized = {"w13_scale": s13, "w2_scale": s2, "scale_block": None}
        bytes_per_weight = 1.0
    if args.grouped:
        rows = _grouped_rows([int(t) for t in args.tokens.split(",")], w13, w2, q13, q2, quantized)
        config = {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTER, "top_k": TOP_K, "weights": "int4",
                  "scales": f"groups of {INT4_GROUP}, asymmetric", "path": "grouped"}  # fmt: skip
        name = "moe-int4-grouped"
        print(
            f"wrote {write_result(name, config, {'rows': rows}, args.result_dir, args.result_name or name)}"
        )
        return
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn((tokens, HIDDEN), device="cuda", dtype=torch.bfloat16)
        logits = torch.randn((tokens, EXPERTS), device="cuda", dtype=torch.bfloat16)
        tuned = moe_tiles(EXPERTS, INTER, HIDDEN, torch.bfloat16, tokens, TOP_K)
        if tuned.method != "gemv":
            continue
        weights_read = tokens * TOP_K * 3 * INTER * HIDDEN  # at most, if no two tokens share an expert
        bytes_read = weights_read * bytes_per_weight

        def call(w_a, w_b, tiles, extra, x=x, logits=logits):
            return lambda: routed_fused_moe(x, logits, w_a, w_b, TOP_K, True, True, tiles, **extra)

        bf16_us = _graph_time_us(call(w13, w2, tuned, {}))
        rows.append({"tokens": tokens, "weights": "bf16", "tiles": "tuned", "us": bf16_us,
                     "bytes_per_s": 2 * weights_read / bf16_us * 1e6})  # fmt: skip
        print(
            f"{tokens} tokens  bf16 tuned tiles: {bf16_us:7.2f} us ({2 * weights_read / bf16_us / 1e6:.2f} TB/s)"
        )
        for label, g, d in _candidates(tuned, args.weights):
            tiles = MoETiles(tuned.block_m, g, d, "gemv")
            try:
                us = _graph_time_us(call(q13, q2, tiles, quantized))
            except Exception as err:  # a tile Triton cannot compile (shared memory): record it
                print(f"  {label}: failed ({type(err).__name__})")
                continue
            rows.append({"tokens": tokens, "weights": args.weights, "candidate": label, "gate_up": asdict(g),
                         "down": asdict(d), "us": us, "bytes_per_s": bytes_read / us * 1e6,
                         "vs_bf16": bf16_us / us})  # fmt: skip
            print(
                f"  {args.weights} {label}: {us:7.2f} us ({bytes_read / us / 1e6:.2f} TB/s, {bf16_us / us:.2f}x bf16)"
            )
    scales = "per row" if args.weights == "fp8" else f"groups of {INT4_GROUP}, asymmetric"
    config = {"experts": EXPERTS, "hidden": HIDDEN, "intermediate": INTER, "top_k": TOP_K, "weights": args.weights,
              "scales": scales}  # fmt: skip
    name = f"moe-{args.weights}-tiles"
    print(f"wrote {write_result(name, config, {'rows': rows}, args.result_dir, args.result_name or name)}")


INT4_GROUP = 128


def _grouped_rows(token_counts, w13, w2, q13, q2, quantized) -> list[dict]:
    """The grouped GEMMs (prefill): bf16 at its tuned tiles, INT4 at the same tiles with the stage
    rule, then INT4 at 1-4 stages for both kernels with the rule bypassed."""
    from dataclasses import replace

    import triton

    from tokenmill.kernels.triton import fused_moe
    from tokenmill.kernels.triton.fused_moe import routed_fused_moe, tiles_for_int4
    from tokenmill.kernels.triton.moe_tile_configs import MoETiles, moe_tiles

    ruled_stages = fused_moe.int4_plane_stages
    rows = []
    for tokens in token_counts:
        tuned = moe_tiles(EXPERTS, INTER, HIDDEN, torch.bfloat16, tokens, TOP_K)
        if tuned.method == "gemv":
            print(f"{tokens} tokens: the tuned tiles take the GEMVs; skipped")
            continue
        x = torch.randn((tokens, HIDDEN), device="cuda", dtype=torch.bfloat16)
        logits = torch.randn((tokens, EXPERTS), device="cuda", dtype=torch.bfloat16)

        def call(w_a, w_b, tiles, extra, x=x, logits=logits):
            return lambda: routed_fused_moe(x, logits, w_a, w_b, TOP_K, True, True, tiles, **extra)

        bf16_us = _graph_time_us(call(w13, w2, tuned, {}), replays=50)
        ruled = tiles_for_int4(tuned, tokens, hidden=HIDDEN, inter=INTER, group_size=INT4_GROUP)
        row = {"tokens": tokens, "bf16_us": bf16_us, "tiles": asdict(tuned), "ruled_stages":
               (ruled.gate_up.num_stages, ruled.down.num_stages)}  # fmt: skip
        row["int4_us"] = _graph_time_us(call(q13, q2, tuned, quantized), replays=50)
        planes = fused_moe.int4_planes
        fused_moe.int4_planes = lambda *_args: False  # the per-weight gather, for comparison
        try:
            ruled_gather = tiles_for_int4(tuned, tokens, hidden=HIDDEN, inter=INTER, group_size=INT4_GROUP)
            row["int4_gather_us"] = _graph_time_us(call(q13, q2, ruled_gather, quantized), replays=50)
        finally:
            fused_moe.int4_planes = planes
        print(f"{tokens} tokens  bf16 {bf16_us:8.1f} us  INT4 (stages {row['ruled_stages']}) {row['int4_us']:8.1f} us "
              f"({bf16_us / row['int4_us']:.2f}x bf16)")  # fmt: skip
        print(f"  gather: {row['int4_gather_us']:8.1f} us")
        sweep = {}
        fused_moe.int4_plane_stages = lambda tiles, *_args, **_kwargs: tiles.num_stages
        try:
            for stages in (1, 2, 3, 4):
                tiles = MoETiles(tuned.block_m, replace(tuned.gate_up, num_stages=stages),
                                 replace(tuned.down, num_stages=stages), tuned.method)  # fmt: skip
                try:
                    sweep[stages] = _graph_time_us(call(q13, q2, tiles, quantized), replays=50)
                    print(f"  {stages} stages: {sweep[stages]:8.1f} us")
                except triton.runtime.errors.OutOfResources as err:  # the point of the sweep: record it
                    sweep[stages] = f"out of resources: {err}"
                    print(f"  {stages} stages: {sweep[stages]}")
        finally:
            fused_moe.int4_plane_stages = ruled_stages
        row["int4_us_by_stages"] = sweep
        rows.append(row)
    return rows


def _int4_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The experts as `--quantization awq` leaves them on the GPU (groups of 128, float32 scales)."""
    from tokenmill.model.layers.moe_int4 import _kernel_form
    from tokenmill.model.layers.quantize_weights import quantize_int4

    forms = [
        [quantize_int4(m, INT4_GROUP, symmetric=False, scale_dtype=torch.float32) for m in w]
        for w in (w13, w2)
    ]
    (q13, s13, z13), (q2, s2, z2) = (_kernel_form(f, torch.float32) for f in forms)
    quantized = {"w13_scale": s13, "w2_scale": s2, "w13_zeros": z13, "w2_zeros": z2, "group_size": INT4_GROUP}
    return q13, q2, quantized


def _candidates(tuned, weights: str):
    """(label, gate/up tiles, down tiles) to time against the tuned bf16 ones."""
    from tokenmill.kernels.triton.moe_tile_configs import GemmTiles

    gate_up, down = tuned.gate_up, tuned.down
    if weights == "fp8":
        for k_scale in (1, 2, 4):
            for n_scale in (1, 2):
                g = GemmTiles(block_n=gate_up.block_n * n_scale, block_k=gate_up.block_k * k_scale,
                              num_warps=gate_up.num_warps, num_stages=gate_up.num_stages)  # fmt: skip
                d = GemmTiles(block_n=down.block_n * n_scale, block_k=min(INTER, down.block_k * k_scale),
                              num_warps=down.num_warps, num_stages=down.num_stages)  # fmt: skip
                yield f"block_k x{k_scale} block_n x{n_scale}", g, d
        return
    from tokenmill.kernels.triton.fused_moe import INT4_GEMV_TILES

    yield "bf16 tiles", gate_up, down
    for name, (g, d) in INT4_GEMV_TILES.items():
        yield f"INT4 defaults ({name})", g, d
    for g_n in (8, 16):  # gate rows; the tile holds as many up rows
        for d_n in (4, 8):
            for block_k in (256, 512, 1024):  # BLOCK_K / 256 packs an iteration (int4_packs_per_step)
                for warps in (2, 4):
                    g = GemmTiles(block_n=g_n, block_k=block_k, num_warps=warps, num_stages=2)
                    d = GemmTiles(block_n=d_n, block_k=block_k, num_warps=warps, num_stages=2)
                    yield f"gate_up n{g_n}, down n{d_n}, {block_k // 256} packs a step, w{warps}", g, d


if __name__ == "__main__":
    main()
