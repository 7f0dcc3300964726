"""The host-memory KV tier (--kv-offload-gb): TTFT of multi-turn re-hits served from the host tier
against recomputing a prompt of the same length, in one engine, one run.

Workload: --conversations conversations, each a first turn of --context random tokens (one at a
time), so that the device pool (--num-kv-blocks, or --gpu-memory-utilization) cannot hold them all
and the earlier ones are evicted to the host tier. Then each conversation's second turn (its first
turn, the answer, --turn-tokens new tokens): a prefix hit, served by the device cache where the
blocks survived and by the host tier where they were evicted; right after each, a control prompt of
the same length with no cached prefix (recomputed whole). Every request runs alone (the TTFT is
that request's own prefill). Reports per kind the TTFT median and the ratio of the medians, with
the engine's counters (host hits, blocks stored and loaded, device prefix hits) so a reader can see
where the re-hits came from.

Examples:
  CPU (default model):   python benchmarks/kv_offload.py --device cpu --context 512 --num-kv-blocks 96
  GPU (8B shapes, dummy): python benchmarks/kv_offload.py --model meta-llama/Llama-3.1-8B-Instruct \
      --load-format dummy --context 8192 --conversations 12 --gpu-memory-utilization 0.35 --kv-offload-gb 32

Writes one result JSON (benchmarks/results format) under --result-dir.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any


def _ttft(llm: Any, request_id: str, prompt: list[int], output_len: int) -> tuple[float, list[int], int]:
    """(seconds to the first token, the output tokens, cached prompt tokens) of one request alone."""
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    started = time.perf_counter()
    llm.engine.add_request(llm.input_processor.make_request(request_id, prompt, params))
    first = None
    tokens: list[int] = []
    cached = 0
    while llm.engine.has_work():
        for out in llm.engine.step():
            if out.request_id != request_id:
                continue
            if out.new_token_ids and first is None:
                first = time.perf_counter() - started
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
    assert first is not None, f"{request_id} produced no token"
    return first, tokens, cached


def run(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from tokenmill.engine.llm import LLM

    max_model_len = args.context + args.turn_tokens + 2 * args.output_len + 16
    kwargs: dict[str, Any] = dict(
        max_model_len=max_model_len, kv_offload_gb=args.kv_offload_gb, load_format=args.load_format,
        max_num_seqs=4, async_scheduling=False,
    )  # fmt: skip
    if args.device:
        kwargs["device"] = args.device
    if args.num_kv_blocks:
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    llm = LLM(args.model, **kwargs)
    info = llm.engine.info
    vocab = info.vocab_size
    rng = random.Random(0)
    device_tokens = info.num_kv_blocks * info.block_size
    print(
        f"device pool {device_tokens} tokens; {args.conversations} conversations of {args.context} tokens "
        f"({args.conversations * args.context} in all)",
        flush=True,
    )
    _ttft(llm, "warmup", [rng.randrange(5, vocab) for _ in range(64)], 2)

    first_turns = [[rng.randrange(5, vocab) for _ in range(args.context)] for _ in range(args.conversations)]
    answers = []
    cold_first: list[float] = []
    for i, prompt in enumerate(first_turns):
        ttft, tokens, _ = _ttft(llm, f"c{i}-t1", prompt, args.output_len)
        cold_first.append(ttft)
        answers.append(tokens)
        print(f"  first turn {i + 1}/{args.conversations}: ttft {ttft:.3f} s", flush=True)
    before = llm.engine.get_stats()
    rehit: list[float] = []
    recompute: list[float] = []
    rows = []
    for i, prompt in enumerate(first_turns):
        second = prompt + answers[i] + [rng.randrange(5, vocab) for _ in range(args.turn_tokens)]
        stats_before = llm.engine.get_stats()
        ttft_hit, _, cached = _ttft(llm, f"c{i}-t2", second, args.output_len)
        stats_after = llm.engine.get_stats()
        host_hit = stats_after.get("kv_offload_hits", 0) - stats_before.get("kv_offload_hits", 0)
        control = [rng.randrange(5, vocab) for _ in range(len(second))]
        ttft_cold, _, cold_cached = _ttft(llm, f"c{i}-cold", control, args.output_len)
        rehit.append(ttft_hit)
        recompute.append(ttft_cold)
        rows.append(
            {
                "conversation": i, "prompt_tokens": len(second), "cached_tokens": cached,
                "host_hit_tokens": host_hit, "ttft_rehit_s": ttft_hit, "ttft_recompute_s": ttft_cold,
                "control_cached_tokens": cold_cached,
            }
        )  # fmt: skip
        print(
            f"  second turn {i + 1}: {len(second)} tokens, cached {cached} (host {host_hit}), "
            f"ttft {ttft_hit:.3f} s vs recompute {ttft_cold:.3f} s",
            flush=True,
        )
    after = llm.engine.get_stats()
    keys = ("kv_offload_hits", "kv_offload_blocks_stored", "kv_offload_blocks_loaded", "prefix_cache_hits")
    deltas = {key: after.get(key, 0) - before.get(key, 0) for key in keys}
    host_rows = [r for r in rows if r["host_hit_tokens"] > 0]
    summary = {
        "device_pool_tokens": device_tokens,
        "ttft_first_turn_median_s": statistics.median(cold_first),
        "ttft_rehit_median_s": statistics.median(rehit),
        "ttft_recompute_median_s": statistics.median(recompute),
        "recompute_over_rehit": statistics.median(recompute) / statistics.median(rehit),
        "host_rehits": len(host_rows),
        "ttft_host_rehit_median_s": statistics.median([r["ttft_rehit_s"] for r in host_rows]) if host_rows else None,
        "ttft_host_rehit_recompute_median_s": (
            statistics.median([r["ttft_recompute_s"] for r in host_rows]) if host_rows else None
        ),
        "second_turn_counters": deltas,
        "device": info.device,
        "dtype": info.dtype,
        "rows": rows,
    }
    if host_rows:
        summary["recompute_over_host_rehit"] = (
            summary["ttft_host_rehit_recompute_median_s"] / summary["ttft_host_rehit_median_s"]
        )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the default model)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default=None, help="cpu, cuda (default: auto)")
    parser.add_argument("--context", type=int, default=512, help="tokens of each conversation's first turn")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=32, help="new tokens of each second turn")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="device pool size (make it too small)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--kv-offload-gb", type=float, default=1.0, help="the host tier's size")
    parser.add_argument("--result-dir", default="benchmarks/results")
    args = parser.parse_args()
    from tokenmill.bench.results import write_result

    metrics = run(args)
    print(
        f"TTFT median: re-hit {metrics['ttft_rehit_median_s']:.3f} s, recompute "
        f"{metrics['ttft_recompute_median_s']:.3f} s ({metrics['recompute_over_rehit']:.2f}x); "
        f"host re-hits {metrics['host_rehits']}/{args.conversations}"
    )
    path = write_result("kv_offload", vars(args), metrics, out_dir=args.result_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
