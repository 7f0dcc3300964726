"""Tune the fused MoE kernel's tiles per batch size and write them into the repo's config files.

For each expert shape (E, I, H, top-k) and batch of T tokens: random top-k routing, then, for each
candidate rows-per-expert-block (block_m), each GEMM's candidate tiles are timed alone (gate/up
with its SiLU epilogue; down with its routing-weight epilogue) over the same aligned blocks, and
the block_m whose best pair makes the fastest whole `routed_fused_moe` (routing, align and the
sum over k included) wins; batches of up to 32 tokens also try the GEMV path (fused_moe_gemv.py,
routing inside its gate/up launch) the same way. Times are CUDA-graph replays (decode steps run as graphs), each replay running the
kernel for several different routings so that small batches do not find their experts' weights
in L2. The candidates are compiled first in parallel processes (Triton's on-disk cache), which is
most of the wall time otherwise.

Writes src/tokenmill/kernels/triton/moe_configs/E=..,I=..,H=..,dtype=...json (kernels/triton/
moe_tile_configs.py reads them) with the device, versions and the time of each entry.

    PYTHONPATH=src python3 benchmarks/tune_fused_moe.py --shape qwen3-30b-a3b --shape mixtral-8x7b
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as dt
import functools
import json
import multiprocessing
import os
import time

import torch

SHAPES = {  # name: (experts, intermediate, hidden, top_k)
    "mixtral-8x7b": (8, 14336, 4096, 2),
    "qwen3-30b-a3b": (128, 768, 2048, 8),
}
# The routing the GEMV path runs inside its gate/up launch: (renormalize, weights rounded to the
# logits' dtype), as the models do (Mixtral: renormalized, float32; Qwen3: norm_topk_prob, rounded).
ROUTING = {"mixtral-8x7b": (True, False), "qwen3-30b-a3b": (True, True)}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
NUM_ROUTINGS_SMALL = 4  # routings per timed replay for batches of up to 128 tokens


def _tiles(spec: tuple[int, int, int, int], group_m: int):
    from tokenmill.kernels.triton.moe_tile_configs import GemmTiles

    block_n, block_k, warps, stages = spec
    return GemmTiles(block_n=block_n, block_k=block_k, group_m=group_m, num_warps=warps, num_stages=stages)


# (block_n, block_k, warps, stages). The first rows read whole weight rows per program in one
# stage, as the dense row GEMV (gemv.py) does at batch 1; the rest tile K.
GEMV_SPECS = [(1, 2048, 8, 1), (1, 2048, 4, 1), (2, 2048, 8, 1), (2, 1024, 8, 1), (4, 1024, 8, 1),
              (1, 1024, 4, 1), (2, 512, 4, 2), (4, 512, 4, 2), (1, 256, 2, 3), (2, 256, 4, 3), (4, 256, 4, 3),
              (8, 256, 4, 2), (8, 512, 8, 2), (8, 128, 4, 3), (16, 128, 4, 3), (16, 256, 8, 2)]  # fmt: skip


def candidates(num_tokens: int, top_k: int, num_experts: int) -> list[tuple[str, int, list]]:
    """(method, block_m, [GemmTiles]) to try for a batch of `num_tokens` tokens."""
    pairs_per_expert = num_tokens * top_k / num_experts
    plans: list[tuple[str, int, list]] = []
    if num_tokens <= 32:  # a few tokens: the per-pair / per-token GEMVs may beat the grouped GEMMs
        plans.append(("gemv", 16, [_tiles(s, 1) for s in GEMV_SPECS]))
    if pairs_per_expert <= 8:  # decode-like: a few rows per expert, a weight read
        specs = [(n, k, 4, s) for n in (32, 64, 128) for k in (64, 128, 256) for s in (3, 4, 5)]
        return [*plans, ("grouped", 16, [_tiles(s, 1) for s in specs])]
    if pairs_per_expert <= 48:
        specs = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
                 (64, 64, 4, 4), (128, 64, 4, 4)]  # fmt: skip
        return [*plans, *(("grouped", m, [_tiles(s, 8) for s in specs]) for m in (16, 32, 64))]
    specs = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3),
             (128, 64, 4, 4), (128, 64, 8, 4)]  # fmt: skip
    return [*plans, *(("grouped", m, [_tiles(s, 8) for s in specs]) for m in (64, 128))]


def fits_shared_memory(
    method: str, kernel: str, block_m: int, tiles, itemsize: int = 2, limit: int = 220 * 1024
) -> bool:
    if method == "gemv":  # registers only: accumulators of [BLOCK_N, BLOCK_K] (two for gate/up)
        return tiles.block_n * tiles.block_k * (2 if kernel == "gate_up" else 1) <= 16384
    b_tiles = 2 if kernel == "gate_up" else 1  # gate/up read two weight tiles per step
    per_stage = (block_m * tiles.block_k + b_tiles * tiles.block_k * tiles.block_n) * itemsize
    return tiles.num_stages * per_stage <= limit


def _compile_jobs(jobs: list[tuple]) -> list[str]:
    """Worker: compile each (method, kernel, shape name, dtype name, block_m, tiles); return the
    failures."""
    from tokenmill.kernels.triton.fused_moe import compile_gemm
    from tokenmill.kernels.triton.fused_moe_gemv import compile_gemv

    torch.cuda.init()
    failures = []
    for method, kernel, name, dtype_name, block_m, tiles in jobs:
        experts, inter, hidden, top_k = SHAPES[name]
        renormalize, rounded = ROUTING[name]
        dtype = getattr(torch, dtype_name)
        try:
            if method == "gemv":
                compile_gemv(
                    kernel, experts, inter, hidden, top_k, dtype, tiles, renormalize=renormalize,
                    round_to_logits_dtype=rounded,
                )  # fmt: skip
            else:
                compile_gemm(kernel, experts, inter, hidden, top_k, dtype, block_m, tiles)
        except Exception as err:  # reported; the timing pass then compiles (or skips) it itself
            failures.append(f"{method} {kernel} block_m={block_m} {tiles}: {type(err).__name__}: {str(err)[:200]}")
    return failures


def precompile(jobs: list[tuple], workers: int) -> None:
    started = time.perf_counter()
    chunks = [jobs[i::workers] for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        failures = [f for result in pool.map(_compile_jobs, chunks) for f in result]
    print(f"compiled {len(jobs)} kernel variants in {time.perf_counter() - started:.1f} s with {workers} processes")
    for failure in failures[:10]:
        print("  compile failed:", failure)


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32)


def _per_call_ms(calls: list) -> float:
    """Milliseconds per call: all `calls` in one CUDA graph, replayed (5 replays after one)."""
    from tokenmill.bench.timing import graph_replay_ms

    def run_all() -> None:
        for call in calls:
            call()

    return graph_replay_ms(run_all, reps=5) / len(calls)


def tune_shape(name: str, dtype: torch.dtype, batches: tuple[int, ...]) -> dict:
    import triton

    from tokenmill.kernels.triton import fused_moe as fm
    from tokenmill.kernels.triton import fused_moe_gemv as gemv
    from tokenmill.kernels.triton.moe_align import align_pairs
    from tokenmill.kernels.triton.moe_tile_configs import MoETiles

    experts, inter, hidden, top_k = SHAPES[name]
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dtype) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=dtype) * inter**-0.5
    entries = {}
    for num_tokens in batches:
        routings = NUM_ROUTINGS_SMALL if num_tokens <= 128 else 1
        xs = [torch.randn(num_tokens, hidden, device="cuda", dtype=dtype) for _ in range(routings)]
        routes = [_routing(num_tokens, experts, top_k, seed=r) for r in range(routings)]
        logit_rows = [torch.randn(num_tokens, experts, device="cuda").to(dtype) for _ in range(routings)]
        num_pairs = num_tokens * top_k
        best: tuple[float, MoETiles, float, float] | None = None
        for method, block_m, tile_list in candidates(num_tokens, top_k, experts):
            acts = [torch.randn(num_pairs, inter, device="cuda", dtype=dtype) for _ in range(routings)]
            if method == "gemv":  # the gate/up launch routes from the logits, as the engine runs it
                outs = [torch.empty(num_tokens, hidden, device="cuda", dtype=dtype) for _ in range(routings)]
                renormalize, rounded = ROUTING[name]
                gate_up_calls = [
                    functools.partial(
                        gemv.launch_pair_gate_up, x, gate_up, ids.reshape(-1), act, top_k, weights=w.reshape(-1),
                        router_logits=logits, renormalize=renormalize, round_to_logits_dtype=rounded,
                    )  # fmt: skip
                    for x, act, (w, ids), logits in zip(xs, acts, routes, logit_rows, strict=True)
                ]
                down_calls = [
                    functools.partial(gemv.launch_token_down, act, down, ids.reshape(-1), w.reshape(-1), out, top_k)
                    for act, out, (w, ids) in zip(acts, outs, routes, strict=True)
                ]
            else:
                blocks = [align_pairs(ids, experts, block_m) for _, ids in routes]
                outs = [torch.empty(num_pairs, hidden, device="cuda", dtype=dtype) for _ in range(routings)]
                gate_up_calls = [
                    functools.partial(fm._launch_gate_up, x, gate_up, act, b, top_k, epilogue=fm._ExpertEpilogue())
                    for x, act, b in zip(xs, acts, blocks, strict=True)
                ]
                down_calls = [
                    functools.partial(fm._launch_down, act, down, out, w.reshape(-1), b)
                    for act, out, (w, _), b in zip(acts, outs, routes, blocks, strict=True)
                ]
            picked = {}
            for kernel, calls in (("gate_up", gate_up_calls), ("down", down_calls)):
                timed = []
                for tiles in tile_list:
                    if not fits_shared_memory(method, kernel, block_m, tiles):
                        continue
                    try:
                        timed.append((_per_call_ms([functools.partial(c, tiles=tiles) for c in calls]), tiles))
                    except (triton.runtime.errors.OutOfResources, RuntimeError) as err:
                        print(f"  {name} T={num_tokens} {method} {kernel} block_m={block_m} {tiles}: skipped ({err})")
                if not timed:
                    break
                picked[kernel] = min(timed, key=lambda t: t[0])
            if len(picked) < 2:
                continue
            tiles = MoETiles(block_m, picked["gate_up"][1], picked["down"][1], method)
            renormalize, rounded = ROUTING[name]
            whole = [  # routing included, as SparseMoEBlock calls it
                functools.partial(fm.routed_fused_moe, x, logits, gate_up, down, top_k, renormalize, rounded, tiles)
                for x, logits in zip(xs, logit_rows, strict=True)
            ]
            total_ms = _per_call_ms(whole)
            if best is None or total_ms < best[0]:
                best = (total_ms, tiles, picked["gate_up"][0], picked["down"][0])
        if best is None:
            raise RuntimeError(f"{name}: no candidate tiles ran for {num_tokens} tokens")
        total_ms, tiles, gate_up_ms, down_ms = best
        active_bytes = min(num_pairs, experts) * 3 * inter * hidden * gate_up.element_size()
        entries[str(num_tokens)] = {
            **tiles.to_json(),
            "us": round(total_ms * 1000, 2),
            "gate_up_us": round(gate_up_ms * 1000, 2),
            "down_us": round(down_ms * 1000, 2),
        }
        print(
            f"{name} T={num_tokens:5d}: {total_ms * 1000:9.1f} us (gate_up {gate_up_ms * 1000:.1f}, "
            f"down {down_ms * 1000:.1f}); expert weights read at most {active_bytes / total_ms / 1e6:.0f} GB/s; "
            f"{tiles.to_json()}"
        )
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="expert shape (repeatable)")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="token counts to tune")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1), help="compile processes")
    parser.add_argument("--out-dir", default=None, help="where to write (default: the repo's moe_configs)")
    parser.add_argument(
        "--merge", action="store_true",
        help="keep the existing file's entries for the batches not tuned now (tune a few batches again)",
    )  # fmt: skip
    args = parser.parse_args()

    import triton

    from tokenmill.bench.results import git_commit
    from tokenmill.kernels.triton.moe_tile_configs import CONFIG_DIR, config_file_name

    dtype = getattr(torch, args.dtype)
    shapes = args.shape or sorted(SHAPES)
    batches = tuple(int(b) for b in args.batches.split(","))
    jobs = []
    for name in shapes:
        experts, inter, hidden, top_k = SHAPES[name]
        variants = {(p[0], p[1], t) for b in batches for p in candidates(b, top_k, experts) for t in p[2]}
        for kernel in ("gate_up", "down"):
            jobs += [
                (method, kernel, name, args.dtype, m, t)
                for method, m, t in sorted(variants, key=str)
                if fits_shared_memory(method, kernel, m, t)
            ]
    precompile(jobs, args.workers)
    out_dir = args.out_dir or CONFIG_DIR
    os.makedirs(out_dir, exist_ok=True)
    for name in shapes:
        experts, inter, hidden, top_k = SHAPES[name]
        started = time.perf_counter()
        entries = tune_shape(name, dtype, batches)
        record = {
            "shape": {"name": name, "experts": experts, "intermediate": inter, "hidden": hidden, "top_k": top_k},
            "dtype": args.dtype,
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "commit": git_commit(),
            "tuned_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "tuned_by": "benchmarks/tune_fused_moe.py (CUDA-graph replays; 'us' = routed_fused_moe per call)",
            "configs": entries,
        }
        path = os.path.join(out_dir, config_file_name(experts, inter, hidden, dtype))
        existing = CONFIG_DIR / config_file_name(experts, inter, hidden, dtype)
        if args.merge and existing.is_file():
            previous = json.loads(existing.read_text())
            kept = previous["configs"]
            record["configs"] = dict(sorted({**kept, **entries}.items(), key=lambda kv: int(kv[0])))
            record["merged_with"] = {
                "device": previous.get("device"), "kept": sorted((k for k in kept if k not in entries), key=int),
            }  # fmt: skip
        with open(path, "w") as f:
            f.write(json.dumps(record, indent=1) + "\n")
        print(f"wrote {path} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
