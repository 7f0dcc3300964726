"""FP8 against 16-bit KV cache on one CUDA GPU, in one process: decode speed at long contexts and the
KV pool's capacity. benchmarks/fp8_kv.sh runs it; see there for the command.

engine: for each --kv-cache-dtypes value, one engine (--model, dummy weights) at the same
  --gpu-memory-utilization: its pool (blocks, tokens) from EngineInfo, then for each context in
  --contexts a single stream's decode tok/s (a prompt of that many tokens, then --output-len tokens;
  the best of --iters), and, with --batch > 1, that many streams of --batch-context tokens each.
kernel: the paged-attention decode launch alone (Llama-3.1-8B attention shapes) over bf16 and FP8
  caches at each context, batch 1 and 8, timed as CUDA-graph replays over caches larger than L2
  together (as benchmarks/attention_microbench.py times them).

Writes one result JSON (benchmarks/results format) per part under --result-dir.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any


def _decode_rate(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Decode tok/s of a batch of streams: from the step that gave every stream its first token to
    the last, all streams' tokens over that time."""
    import torch

    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(llm.input_processor.make_request(f"r{i}", prompt, params))
    first: set[str] = set()
    decode_started = None
    decoded = 0
    while llm.engine.has_work():
        outputs = llm.engine.step()
        for out in outputs:
            if decode_started is not None:
                decoded += len(out.new_token_ids)
            elif out.new_token_ids:
                first.add(out.request_id)
        if decode_started is None and len(first) == len(prompts):
            decode_started = time.perf_counter()
    finished = time.perf_counter()
    # (A single stream decodes output_len - 1 tokens here; in a batch, streams that finished their
    # prefill first have decoded some tokens before the last one's first token.)
    assert decode_started is not None and decoded > 0, decoded
    return {
        "prefill_s": decode_started - started,
        "decode_s": finished - decode_started,
        "decode_tokens_per_s": decoded / (finished - decode_started),
    }


def run_engine(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch

    from tokenmill.engine.llm import LLM

    contexts = [int(c) for c in args.contexts.split(",")]
    max_model_len = max([*contexts, args.batch_context]) + args.output_len + 16
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    for kv_dtype in args.kv_cache_dtypes.split(","):
        llm = LLM(
            args.model, load_format="dummy", kv_cache_dtype=kv_dtype, max_model_len=max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(8, args.batch),
            enable_prefix_caching=False,
        )  # fmt: skip
        info = llm.engine.info
        runner = llm.engine.runner
        row: dict[str, Any] = {
            "kv_cache_dtype": str(runner.kv_cache_dtype).removeprefix("torch."),
            "num_kv_blocks": info.num_kv_blocks,
            "kv_capacity_tokens": info.kv_capacity_tokens,
            "kv_bytes_per_token": sum(t[:, 0, 0].numel() * t.element_size() for t in runner.kv_cache_tensors),
            "cuda_graphs": runner.graph_runner is not None,
            "single_stream": {},
        }
        print(f"{kv_dtype}: {info.num_kv_blocks} blocks, {info.kv_capacity_tokens} tokens", flush=True)
        vocab = info.vocab_size
        _decode_rate(llm, [rng.integers(100, vocab, 64).tolist()], 8)  # warm-up
        for context in contexts:
            runs = [
                _decode_rate(llm, [rng.integers(100, vocab, context).tolist()], args.output_len)
                for _ in range(args.iters)
            ]
            best = max(runs, key=lambda r: r["decode_tokens_per_s"])
            row["single_stream"][str(context)] = {**best, "runs": runs}
            print(f"  {kv_dtype} context {context}: {best['decode_tokens_per_s']:.1f} tok/s", flush=True)
        if args.batch > 1:
            prompts = [rng.integers(100, vocab, args.batch_context).tolist() for _ in range(args.batch)]
            batch = _decode_rate(llm, prompts, args.batch_output_len)
            row["batch"] = {"streams": args.batch, "context": args.batch_context, **batch}
            print(
                f"  {kv_dtype} {args.batch} x {args.batch_context}: {batch['decode_tokens_per_s']:.1f} tok/s",
                flush=True,
            )
        results[kv_dtype] = row
        runner.release()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    dtypes = list(results)
    if len(dtypes) == 2:
        base, fp8 = results[dtypes[0]], results[dtypes[1]]
        results["fp8_over_16_bit"] = {
            "capacity": fp8["kv_capacity_tokens"] / base["kv_capacity_tokens"],
            "single_stream": {
                c: fp8["single_stream"][c]["decode_tokens_per_s"] / base["single_stream"][c]["decode_tokens_per_s"]
                for c in base["single_stream"]
            },
        }
        if "batch" in base:
            results["fp8_over_16_bit"]["batch"] = (
                fp8["batch"]["decode_tokens_per_s"] / base["batch"]["decode_tokens_per_s"]
            )
        print(f"fp8 / 16-bit: {results['fp8_over_16_bit']}", flush=True)
    return results


def _graph_ms(backend: Any, qkv: tuple, meta: Any, spec: Any, caches: list, reps: int) -> float:
    """ms per decode attention forward, replayed over every cache in one CUDA graph."""
    from benchmarks.attention_microbench import graph_time_per_forward

    q, k, v = qkv
    return graph_time_per_forward(lambda cache: backend.forward(q, k, v, cache, meta, layer=spec), caches, reps)


def run_kernel(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from benchmarks.attention_microbench import (
        BLOCK,
        HEAD_DIM,
        HEADS,
        KV_HEADS,
        L2_FLUSH_BYTES,
        make_decode_batch,
    )

    from tokenmill.attention.backend import AttentionLayerSpec
    from tokenmill.attention.triton_paged import TritonPagedBackend
    from tokenmill.kernels.kv_fp8 import FP8_KV_DTYPE

    rows = []
    spec = AttentionLayerSpec(
        k_scale=torch.full((KV_HEADS,), 0.05, device="cuda"), v_scale=torch.full((KV_HEADS,), 0.05, device="cuda")
    )
    for batch in (1, 8):
        for context in (int(c) for c in args.contexts.split(",")):
            meta, num_blocks = make_decode_batch([context] * batch, seed=batch)
            q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn(2, batch, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            row: dict[str, Any] = {"batch": batch, "context": context}
            for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8_KV_DTYPE)):
                cache_bytes = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
                copies = max(1, -(-L2_FLUSH_BYTES // cache_bytes))
                caches = [
                    torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
                    for _ in range(copies)
                ]
                backend = TritonPagedBackend(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, BLOCK)
                backend.prepare_for_capture(max_num_reqs=batch, max_blocks_per_req=meta.block_tables.shape[1])
                ms = _graph_ms(backend, (q, k, v), meta, spec, caches, args.kernel_reps)
                kv_bytes = batch * (context + 1) * KV_HEADS * HEAD_DIM * 2 * dtype.itemsize
                row[f"{name}_us"] = ms * 1e3
                row[f"{name}_kv_gbs"] = kv_bytes / ms / 1e6
                del caches
                torch.cuda.empty_cache()
            row["fp8_speedup"] = row["bf16_us"] / row["fp8_us"]
            print(
                f"batch {batch} context {context}: bf16 {row['bf16_us']:.1f} us ({row['bf16_kv_gbs']:.0f} GB/s), "
                f"fp8 {row['fp8_us']:.1f} us ({row['fp8_kv_gbs']:.0f} GB/s): {row['fp8_speedup']:.2f}x",
                flush=True,
            )
            rows.append(row)
    return {"decode_attention": rows}


def run_tiles(args: argparse.Namespace) -> dict[str, Any]:
    """The decode launch over an FP8 cache with each tile shape (and the bf16 cache with its own
    tiles, for reference), at batch 1 and 8 and the shortest and longest context."""
    import torch
    import triton
    from benchmarks.attention_microbench import (
        BLOCK,
        HEAD_DIM,
        HEADS,
        KV_HEADS,
        L2_FLUSH_BYTES,
        make_decode_batch,
    )

    from tokenmill.attention.triton_paged import choose_num_kv_splits
    from tokenmill.kernels.kv_fp8 import FP8_KV_DTYPE
    from tokenmill.kernels.triton.paged_attention import TileConfig, decode_tile_config

    contexts = [int(c) for c in args.contexts.split(",")]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    scales = torch.full((KV_HEADS,), 0.05, device="cuda")
    group_pad, dim_pad = triton.next_power_of_2(HEADS // KV_HEADS), HEAD_DIM
    rows = []
    for batch in (1, 8):
        default = decode_tile_config(group_pad, dim_pad, batch)
        candidates = [("bf16", torch.bfloat16, default), ("fp8", FP8_KV_DTYPE, default)] + [
            ("fp8", FP8_KV_DTYPE, TileConfig(1, default.block_m, n, w, st, default.merge_chunk))
            for n in (32, 64, 128) for w in (4, 8) for st in (2, 3)
        ]  # fmt: skip
        for context in (contexts[0], contexts[-1]):
            meta, num_blocks = make_decode_batch([context] * batch, seed=batch)
            splits = choose_num_kv_splits(batch, KV_HEADS, context + 1, num_sms)
            q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            scratch = (
                torch.empty(batch, HEADS, splits, HEAD_DIM, device="cuda"),
                torch.empty(batch, HEADS, splits, device="cuda"),
                torch.zeros(batch * KV_HEADS, dtype=torch.int32, device="cuda"),
            )
            caches_by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for name, dtype, config in candidates:
                if dtype not in caches_by_dtype:
                    caches_by_dtype.clear()
                    torch.cuda.empty_cache()
                    cache_bytes = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
                    caches_by_dtype[dtype] = [
                        torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda").to(dtype)
                        for _ in range(max(1, -(-L2_FLUSH_BYTES // cache_bytes)))
                    ]
                ms = _tile_ms(q, meta, splits, scratch, config, scales, caches_by_dtype[dtype], args.kernel_reps)
                row = {
                    "batch": batch, "context": context, "kv": name, "splits": splits, "block_n": config.block_n,
                    "num_warps": config.num_warps, "num_stages": config.num_stages, "default": config == default,
                    "us": ms * 1e3,
                }  # fmt: skip
                rows.append(row)
                print(row, flush=True)
            caches_by_dtype.clear()
            torch.cuda.empty_cache()
    return {"decode_tiles": rows}


def _tile_ms(q, meta, splits, scratch, config, scales, caches, reps) -> float:  # noqa: ANN001
    import torch
    from benchmarks.attention_microbench import graph_time_per_forward

    from tokenmill.kernels.triton.paged_attention import paged_attention

    out = torch.empty_like(q)

    def forward(cache: torch.Tensor) -> None:
        paged_attention(
            out, q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            num_reqs=meta.num_reqs, max_query_len=1, decode_only=True, scale=q.shape[-1] ** -0.5,
            num_kv_splits=splits, partial_out=scratch[0], partial_lse=scratch[1], split_counters=scratch[2],
            decode_config=config, all_decode=True, k_scale=scales, v_scale=scales,
        )  # fmt: skip

    return graph_time_per_forward(forward, caches, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", choices=["engine", "kernel", "tiles"], action="append", help="default: kernel and engine"
    )
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--kv-cache-dtypes", default="auto,fp8", help="the 16-bit one first")
    parser.add_argument("--contexts", default="8192,16384,32768", help="prompt tokens per single stream")
    parser.add_argument("--output-len", type=int, default=128, help="tokens decoded per single stream")
    parser.add_argument("--iters", type=int, default=2, help="timed single streams per context; best reported")
    parser.add_argument("--batch", type=int, default=8, help="streams of the batched run (1: none)")
    parser.add_argument("--batch-context", type=int, default=16384)
    parser.add_argument("--batch-output-len", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kernel-reps", type=int, default=20)
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-name", default="fp8-kv", help="file name prefix of the result JSONs")
    args = parser.parse_args()

    from tokenmill.bench.results import write_result

    parts = args.part or ["kernel", "engine"]
    config = {k: v for k, v in vars(args).items() if k not in ("result_dir", "result_name", "part")}
    for part in parts:
        metrics = {"kernel": run_kernel, "engine": run_engine, "tiles": run_tiles}[part](args)
        path = write_result(
            f"fp8_kv_{part}", config, metrics, out_dir=args.result_dir, name=f"{args.result_name}-{part}"
        )
        print(f"wrote {path}", flush=True)


if __name__ == "__main__":
    main()
