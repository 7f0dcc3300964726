"""The verify-cost curve of speculative decoding: a step of q = 1 + k tokens per request against
a step of one, through the runner's CUDA graphs (issue 17), and the attention kernel alone.

    PYTHONPATH=src python benchmarks/spec_verify_cost.py --model benchmarks/configs/llama-3.1-8b

Part `steps`: dummy weights at the model's shapes; for each batch size B and query length q, a
SchedulerOutput in which every request computes q known tokens at decode positions after a
`--context-len` context (benchmarks drafts with known tokens: bench/decode_steps.py), run through
ModelRunner.execute with CUDA graphs captured for q = 1..8 (worker/cuda_graphs.py's
spec_tokens_per_request). Each step's wall time (the runner waits for its sampled ids) is timed
`--steps` times after `--warmup` steps; the median is reported, and step(q) / step(1).

Part `attention`: the Triton paged attention alone (GQA 32/8 heads, head 128, bf16), a decode
step of B requests with q query tokens each (q > 1 as multi-token decodes) at each context,
timed in a CUDA graph (triton.testing.do_bench_cudagraph, median); the time per KV byte read
(every request's context once: K and V) and time(q) / time(1).

Writes one JSON result per part to --out-dir and prints the ratio tables last.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _trim_histories(runner, request_ids: list[str], length: int) -> None:
    """Undo the token each step appended, so the repeated step samples again at the same positions."""
    for rid in request_ids:
        state = runner.requests[rid]
        del state.token_ids[length:]
        state.num_tokens = length


def run_steps(args) -> tuple[dict, dict]:
    import torch

    from tokenmill import LLM
    from tokenmill.bench.decode_steps import blocks_needed, uniform_decode_step
    from tokenmill.worker.cuda_graphs import CudaGraphRunner

    batch_sizes, qs = _ints(args.batch_sizes), _ints(args.tokens_per_request)
    max_b, max_q = max(batch_sizes), max(qs)
    llm = LLM(
        args.model,
        load_format="dummy",
        device="cuda",
        max_model_len=args.context_len + 64,
        max_num_seqs=max_b,
        max_num_batched_tokens=max(2048, max_b * max_q),
        gpu_memory_utilization=args.gpu_memory_utilization,
        kernel_config={"piecewise_cuda_graphs": False},  # decode steps only: whole-step graphs
    )
    runner = llm.engine.runner
    block_size = runner.block_size
    needed = blocks_needed(max_b, max_q, args.context_len, block_size)
    if needed > runner.num_blocks:
        raise SystemExit(f"the KV pool has {runner.num_blocks} blocks; batch {max_b} at {args.context_len} needs {needed}")
    for cache in runner.kv_cache_tensors:  # random K/V (not zeros, not uninitialised memory)
        cache.normal_()
    started = time.perf_counter()
    runner.graph_runner = None
    torch.cuda.empty_cache()
    graphs = CudaGraphRunner(
        runner.model, runner.attn_backend, runner.buffers, runner.kv_caches, max_b,
        spec_tokens_per_request=tuple(sorted({1, *qs})),
    )  # fmt: skip
    graphs.capture()
    runner.graph_runner = graphs
    capture_s = time.perf_counter() - started
    vocab = runner.arch.vocab_size
    table = {}
    for b in batch_sizes:
        for q in qs:
            first, again = uniform_decode_step(
                b, q, args.context_len, block_size, vocab, seed=b * 100 + q, id_prefix=f"b{b}q{q}-"
            )
            ids = list(again.num_scheduled_tokens)
            length = args.context_len + q
            replays = graphs.num_replays
            runner.execute(first)
            _trim_histories(runner, ids, length)
            times = []
            for i in range(args.warmup + args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = runner.execute(again)
                elapsed = time.perf_counter() - t0
                _trim_histories(runner, ids, length)
                if i >= args.warmup:
                    times.append(elapsed)
            if graphs.num_replays - replays != 1 + args.warmup + args.steps or len(out.req_ids) != b:
                raise SystemExit(f"B={b} q={q}: not every step replayed a graph or sampled every request")
            runner.requests.update(type(again)(finished_req_ids=set(ids)))  # drop the states
            table[(b, q)] = {
                "median_ms": 1000 * statistics.median(times),
                "min_ms": 1000 * min(times),
                "graph_batch": out.cuda_graph_size,
            }
            print(f"B={b:3d} q={q}: step {table[(b, q)]['median_ms']:.3f} ms (min {table[(b, q)]['min_ms']:.3f})", flush=True)
    config = {
        "model": args.model,
        "load_format": "dummy",
        "context_len": args.context_len,
        "batch_sizes": batch_sizes,
        "tokens_per_request": qs,
        "steps": args.steps,
        "warmup": args.warmup,
        "attention_backend": runner.attn_backend.name,
        "kernel": dataclasses.asdict(llm.config.kernel),
        "dtype": str(runner.dtype),
        "graph_capture": {str(q): stats for q, stats in graphs.capture_stats.items()},
        "graph_capture_total_s": capture_s,
    }
    metrics = {
        "step_ms": {f"B{b}_q{q}": v["median_ms"] for (b, q), v in table.items()},
        "step_min_ms": {f"B{b}_q{q}": v["min_ms"] for (b, q), v in table.items()},
        "ratio_to_q1": {
            f"B{b}_q{q}": v["median_ms"] / table[(b, 1)]["median_ms"] for (b, q), v in table.items() if (b, 1) in table
        },
    }
    return config, metrics


def run_attention(args) -> tuple[dict, dict]:
    import torch
    import triton

    from tokenmill.attention.backend import AttentionMetadata
    from tokenmill.attention.triton_paged import TritonPagedBackend

    heads, kv_heads, dim, block = 32, 8, 128, 16
    batch_sizes, qs, contexts = _ints(args.batch_sizes), _ints(args.tokens_per_request), _ints(args.attention_contexts)
    device = torch.device("cuda")
    max_blocks = max(batch_sizes) * -(-(max(contexts) + max(qs)) // block)
    cache = torch.randn(2, max_blocks, block, kv_heads, dim, dtype=torch.bfloat16, device=device)
    results = {}
    for ctx in contexts:
        for b in batch_sizes:
            for q in qs:
                seq = ctx + q
                per_req = -(-seq // block)
                # Scattered blocks: request i's pages are interleaved with the others'.
                tables = torch.randperm(max_blocks, device=device)[: b * per_req].view(b, per_req).to(torch.int32)
                qsl = torch.arange(b + 1, dtype=torch.int32) * q
                lens = torch.full((b,), seq, dtype=torch.int32)
                meta = AttentionMetadata(
                    num_actual_tokens=b * q, num_reqs=b, max_query_len=q, max_seq_len=seq,
                    query_start_loc=qsl.to(device), seq_lens=lens.to(device), block_tables=tables,
                    slot_mapping=torch.full((b * q,), -1, dtype=torch.long, device=device),
                    query_start_loc_cpu=qsl, seq_lens_cpu=lens, is_decode_only=q == 1, multi_token_decode=q > 1,
                )  # fmt: skip
                backend = TritonPagedBackend(heads, kv_heads, dim, dim**-0.5, block)
                backend.prepare_for_capture(b, per_req, max_decode_query_len=q)  # the graph split rule
                qt = torch.randn(b * q, heads, dim, dtype=torch.bfloat16, device=device)
                kt = torch.randn(b * q, kv_heads, dim, dtype=torch.bfloat16, device=device)

                def step(backend=backend, qt=qt, kt=kt, meta=meta) -> None:
                    backend.forward(qt, kt, kt, cache, meta, kv_already_stored=True)

                ms = triton.testing.do_bench_cudagraph(step, rep=25, return_mode="median")
                kv_bytes = b * seq * kv_heads * dim * 2 * 2
                results[(ctx, b, q)] = {"ms": ms, "gb_per_s": kv_bytes / (ms * 1e-3) / 1e9}
    for (ctx, b, _q), v in results.items():
        v["ratio_to_q1"] = v["ms"] / results[(ctx, b, 1)]["ms"] if (ctx, b, 1) in results else None
    config = {
        "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": dim, "block_size": block, "dtype": "bfloat16",
        "contexts": contexts, "batch_sizes": batch_sizes, "tokens_per_request": qs,
        "timing": "triton.testing.do_bench_cudagraph(rep=25, median); split rule of prepare_for_capture",
    }  # fmt: skip
    metrics = {f"ctx{c}_B{b}_q{q}": v for (c, b, q), v in results.items()}
    return config, metrics


def _print_ratio_table(title: str, rows: list[int], qs: list[int], ratio) -> None:
    print(title)
    print("       " + "".join(f"{f'q={q}':>8}" for q in qs))
    for r in rows:
        print(f"{r:>6} " + "".join(f"{ratio(r, q):8.3f}" for q in qs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    parser.add_argument("--part", choices=["steps", "attention", "all"], default="all")
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--tokens-per-request", default="1,2,3,4,5,6,7,8", help="q = 1 + k values")
    parser.add_argument("--context-len", type=int, default=1024, help="tokens before each step (steps part)")
    parser.add_argument("--attention-contexts", default="512,1024,2048,4096")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--name", default=None, help="result file name stem (a part suffix is added)")
    args = parser.parse_args()

    import torch

    from tokenmill.bench.results import write_result

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    qs = _ints(args.tokens_per_request)
    batch_sizes = _ints(args.batch_sizes)
    tables = []
    if args.part in ("attention", "all"):
        config, metrics = run_attention(args)
        name = f"{args.name}-attention" if args.name else None
        print(f"wrote {write_result('spec-verify-cost-attention', config, metrics, args.out_dir, name)}")
        for ctx in _ints(args.attention_contexts):
            tables.append((
                f"attention time(q) / time(q=1), context {ctx} (rows: batch)", batch_sizes,
                lambda b, q, ctx=ctx, m=metrics: m[f"ctx{ctx}_B{b}_q{q}"]["ratio_to_q1"],
            ))  # fmt: skip
    if args.part in ("steps", "all"):
        config, metrics = run_steps(args)
        name = f"{args.name}-steps" if args.name else None
        print(f"wrote {write_result('spec-verify-cost-steps', config, metrics, args.out_dir, name)}")
        print(f"graph capture: {config['graph_capture']}")
        tables.append((
            f"runner step(q) / step(q=1), context {args.context_len} (rows: batch)", batch_sizes,
            lambda b, q, m=metrics: m["ratio_to_q1"][f"B{b}_q{q}"],
        ))  # fmt: skip
        tables.append((
            "runner step(q) median ms", batch_sizes, lambda b, q, m=metrics: m["step_ms"][f"B{b}_q{q}"],
        ))  # fmt: skip
    for title, rows, ratio in tables:
        _print_ratio_table(title, rows, qs, ratio)


if __name__ == "__main__":
    main()
