"""The host-memory KV tier (--kv-offload-gb): TTFT of multi-turn re-hits served from the host tier
against recomputing a prompt of the same length, in one engine, one run.

Workload: --conversations conversations, each a first turn of random tokens (one at a time; the
lengths cycle through --contexts), so that the device pool (--num-kv-blocks, or
--gpu-memory-utilization) cannot hold them all and the earlier ones are evicted to the host tier.
Then each conversation's second turn (its first turn, the answer, --turn-tokens new tokens): a
prefix hit, served by the device cache where the blocks survived and by the host tier where they
were evicted; right after each, a control prompt of the same length with no cached prefix
(recomputed whole). Every request runs alone (the TTFT is that request's own prefill). Reports per
context length the TTFT medians of host re-hits and their controls and the ratio, with the
engine's counters (host hits, blocks stored and loaded, device prefix hits).

Last, --bandwidth-tokens (default 4096) times the tier's raw copies with the engine's own pools:
a load of that many tokens (host slots in one run, listed tail first as a request evicted whole
gives them), a save, both in one step into the same device blocks (a re-hit that evicts), and a
load from every other slot (the worst case, one copy per block and layer): seconds, GB/s, copy
calls, and the host time to queue them. It overwrites device blocks, so it runs after the rest.

--copies-only skips the engine and the workload: the same raw copy timings on synthetic pools of
Llama-3.1-8B's shapes (32 layers, 8 KV heads of 128, bf16, blocks of 16 tokens: 128 KiB a token),
in seconds, on --device (default: cuda when there is one); on a GPU also save+load with both on one
stream (what the separate save and load streams buy).

--overlap-ab runs the workload a second time (fresh conversations, same engine) with every
layer's copies waited for before the forward (the tier before per-layer overlap), so the two can
be compared in one run: "overlap" (each layer waits for its own copies) and "wait-all".

Examples:
  CPU (tiny checkpoint): python benchmarks/kv_offload.py --model DIR --device cpu --contexts 256 --num-kv-blocks 64
  GPU (8B shapes, dummy): python benchmarks/kv_offload.py --model benchmarks/configs/llama-3.1-8b \
      --tokenizer .gputok --load-format dummy --contexts 4096,8192,16384 --conversations 9 \
      --num-kv-blocks 3072 --kv-offload-gb 24 --overlap-ab

Writes one result JSON (benchmarks/results format) under --result-dir.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
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


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _wait_for_all_layers_first(connector: Any) -> Callable[[], None]:
    """Make the tier wait for every layer's copies before the forward (as before per-layer
    overlap); returns the undo."""
    start = connector.start_load_kv

    def start_and_wait(metadata: Any) -> None:
        start(metadata)
        connector.wait_for_load()

    connector.start_load_kv = start_and_wait
    return lambda: delattr(connector, "start_load_kv")


def _connector_counters(llm: Any) -> dict[str, int]:
    connector = getattr(llm.engine.runner, "kv_connector", None)
    return {
        "layers_waited_in_forward": getattr(connector, "layers_waited_in_forward", 0),
        "layers_waited_at_once": getattr(connector, "layers_waited_at_once", 0),
        **{
            key: getattr(connector, key, 0)
            for key in ("save_calls", "load_calls", "block_layers_saved", "block_layers_loaded")
        },
    }


def run_pass(llm: Any, args: argparse.Namespace, label: str, seed: int) -> dict[str, Any]:
    """One workload: first turns, then per conversation its second turn and a control prompt."""
    vocab = llm.engine.info.vocab_size
    rng = random.Random(seed)
    lengths = [args.contexts[i % len(args.contexts)] for i in range(args.conversations)]
    first_turns = [[rng.randrange(5, vocab) for _ in range(n)] for n in lengths]
    answers = []
    for i, prompt in enumerate(first_turns):
        ttft, tokens, _ = _ttft(llm, f"{label}-c{i}-t1", prompt, args.output_len)
        answers.append(tokens)
        print(f"  [{label}] first turn {i + 1}/{args.conversations}: {len(prompt)} tokens, ttft {ttft:.3f} s", flush=True)
    before, counters_before = llm.engine.get_stats(), _connector_counters(llm)
    rows = []
    for i, prompt in enumerate(first_turns):
        second = prompt + answers[i] + [rng.randrange(5, vocab) for _ in range(args.turn_tokens)]
        stats_before, copies_before = llm.engine.get_stats(), _connector_counters(llm)
        ttft_hit, _, cached = _ttft(llm, f"{label}-c{i}-t2", second, args.output_len)
        copies = {key: value - copies_before[key] for key, value in _connector_counters(llm).items()}
        host_hit = llm.engine.get_stats().get("kv_offload_hits", 0) - stats_before.get("kv_offload_hits", 0)
        control = [rng.randrange(5, vocab) for _ in range(len(second))]
        ttft_cold, _, cold_cached = _ttft(llm, f"{label}-c{i}-cold", control, args.output_len)
        rows.append(
            {
                "conversation": i, "context": lengths[i], "prompt_tokens": len(second), "cached_tokens": cached,
                "host_hit_tokens": host_hit, "ttft_rehit_s": ttft_hit, "ttft_recompute_s": ttft_cold,
                "control_cached_tokens": cold_cached, **{f"rehit_{key}": value for key, value in copies.items()},
            }
        )  # fmt: skip
        print(
            f"  [{label}] second turn {i + 1}: {len(second)} tokens, cached {cached} (host {host_hit}), "
            f"ttft {ttft_hit:.3f} s vs recompute {ttft_cold:.3f} s; re-hit copy calls: loads "
            f"{copies['load_calls']} for {copies['block_layers_loaded']} block-layers, saves "
            f"{copies['save_calls']} for {copies['block_layers_saved']}",
            flush=True,
        )
    after, counters_after = llm.engine.get_stats(), _connector_counters(llm)
    keys = ("kv_offload_hits", "kv_offload_blocks_stored", "kv_offload_blocks_loaded", "prefix_cache_hits")
    per_context = {}
    for n in args.contexts:
        host = [r for r in rows if r["context"] == n and r["host_hit_tokens"] > 0]
        hit, cold = _median([r["ttft_rehit_s"] for r in host]), _median([r["ttft_recompute_s"] for r in host])
        per_context[str(n)] = {
            "host_rehits": len(host),
            "ttft_host_rehit_median_s": hit,
            "ttft_recompute_median_s": cold,
            "recompute_over_host_rehit": cold / hit if hit and cold else None,
        }
    host_rows = [r for r in rows if r["host_hit_tokens"] > 0]
    hit = _median([r["ttft_rehit_s"] for r in host_rows])
    cold = _median([r["ttft_recompute_s"] for r in host_rows])
    return {
        "host_rehits": len(host_rows),
        "ttft_host_rehit_median_s": hit,
        "ttft_host_rehit_recompute_median_s": cold,
        "recompute_over_host_rehit": cold / hit if hit and cold else None,
        "ttft_rehit_median_s": _median([r["ttft_rehit_s"] for r in rows]),
        "ttft_recompute_median_s": _median([r["ttft_recompute_s"] for r in rows]),
        "per_context": per_context,
        "second_turn_counters": {key: after.get(key, 0) - before.get(key, 0) for key in keys},
        "connector_counters": {key: counters_after[key] - counters_before[key] for key in counters_after},
        "rows": rows,
    }


def copy_bandwidth(connector: Any, block_size: int, tokens: int, repeats: int = 5) -> dict[str, Any]:
    """Median time of each copy pattern (see the module doc) over `repeats`, one step each."""
    import torch

    from tokenmill.core.kv_connector_metadata import HostTierMetadata

    num_device = connector.device_tensors[0].shape[1]
    n = min(tokens // block_size, num_device - 1, connector.num_host_blocks // 2)
    device_blocks = random.Random(0).sample(range(1, num_device), n)  # block 0 may be the null block
    tail_first = list(range(n))[::-1]
    cases = {
        "load": HostTierMetadata(load_host_slots=tail_first, load_device_blocks=device_blocks),
        "save": HostTierMetadata(save_device_blocks=device_blocks, save_host_slots=list(range(n))),
        "save+load": HostTierMetadata(
            save_device_blocks=device_blocks, save_host_slots=list(range(n, 2 * n)),
            load_host_slots=tail_first, load_device_blocks=device_blocks,
        ),
        "load every other slot": HostTierMetadata(
            load_host_slots=list(range(0, 2 * n, 2)), load_device_blocks=device_blocks
        ),
    }  # fmt: skip
    block_bytes = sum(host[0].numel() * host.element_size() for host in connector.host_tensors)
    sync = torch.cuda.synchronize if connector.is_cuda else (lambda: None)
    result: dict[str, Any] = {"tokens": n * block_size, "blocks": n, "bytes_per_block": block_bytes}
    for name, meta in cases.items():
        seconds, queue_seconds = [], []
        calls_before = connector.transfer_calls
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            connector.start_load_kv(meta)
            queued = time.perf_counter()
            connector.wait_for_load()
            sync()
            seconds.append(time.perf_counter() - started)
            queue_seconds.append(queued - started)
        moved = block_bytes * n * (2 if name == "save+load" else 1)
        median = statistics.median(seconds)
        result[name] = {
            "seconds": median, "gb_per_s": moved / median / 1e9, "queue_seconds": statistics.median(queue_seconds),
            "copy_calls": (connector.transfer_calls - calls_before) // repeats, "bytes": moved,
        }  # fmt: skip
    return result


def synthetic_copies(tokens: int, device: str | None) -> dict[str, Any]:
    """copy_bandwidth on a worker over 8B-shaped pools just big enough (no engine)."""
    import torch

    from tokenmill.worker.kv_connector.host_tier import HostKVTierWorker

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    block_size, blocks = 16, tokens // 16
    pool = [torch.zeros(2, blocks + 1, block_size, 8, 128, dtype=torch.bfloat16, device=device) for _ in range(32)]
    worker = HostKVTierWorker(pool, 2 * blocks)
    try:
        result = {"device": device, "dtype": "bfloat16", "copy_bandwidth": copy_bandwidth(worker, block_size, tokens)}
    finally:
        worker.release()
    if device != "cpu":  # the same with saves and loads on one stream: what the two streams buy
        worker = HostKVTierWorker(pool, 2 * blocks, duplex=False)
        try:
            one = copy_bandwidth(worker, block_size, tokens)
            result["copy_bandwidth"]["save+load, one stream"] = one["save+load"]
        finally:
            worker.release()
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.engine.llm import LLM

    max_model_len = max(args.contexts) + args.turn_tokens + 2 * args.output_len + 16
    kwargs: dict[str, Any] = dict(
        max_model_len=max_model_len, kv_offload_gb=args.kv_offload_gb, load_format=args.load_format,
        max_num_seqs=4, async_scheduling=False,
    )  # fmt: skip
    for name in ("device", "tokenizer", "num_kv_blocks", "gpu_memory_utilization", "max_num_batched_tokens"):
        if getattr(args, name):
            kwargs[name] = getattr(args, name)
    started = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    info = llm.engine.info
    device_tokens = info.num_kv_blocks * info.block_size
    total = sum(args.contexts[i % len(args.contexts)] for i in range(args.conversations))
    print(
        f"engine up in {time.perf_counter() - started:.0f} s; device pool {device_tokens} tokens; "
        f"{args.conversations} conversations, {total} first-turn tokens in all",
        flush=True,
    )
    _ttft(llm, "warmup", [random.Random(0).randrange(5, info.vocab_size) for _ in range(64)], 2)
    passes = {"overlap": run_pass(llm, args, "overlap", seed=1)}
    if args.overlap_ab:
        if llm.engine.runner.kv_connector is None:
            raise SystemExit("--overlap-ab needs the tier on (--kv-offload-gb > 0)")
        undo = _wait_for_all_layers_first(llm.engine.runner.kv_connector)
        try:
            passes["wait-all"] = run_pass(llm, args, "wait-all", seed=2)
        finally:
            undo()
    metrics = {"device_pool_tokens": device_tokens, "device": info.device, "dtype": info.dtype, "passes": passes}
    connector = llm.engine.runner.kv_connector
    if args.bandwidth_tokens and connector is not None:
        metrics["copy_bandwidth"] = copy_bandwidth(connector, info.block_size, args.bandwidth_tokens)
    return metrics


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def summary_lines(metrics: dict[str, Any]) -> list[str]:
    lines = []
    if "passes" in metrics:
        lines.append(f"host tier TTFT ({metrics['device']}, device pool {metrics['device_pool_tokens']} tokens):")
    for label, result in metrics.get("passes", {}).items():
        counters = result["connector_counters"]
        lines.append(
            f"  {label}: host re-hits {result['host_rehits']}, TTFT median re-hit "
            f"{_fmt(result['ttft_host_rehit_median_s'])} s vs recompute "
            f"{_fmt(result['ttft_host_rehit_recompute_median_s'])} s = "
            f"{_fmt(result['recompute_over_host_rehit'], '.2f')}x; layers waited in forward "
            f"{counters['layers_waited_in_forward']}, at once {counters['layers_waited_at_once']}"
        )
        rows = result["rows"]
        lines.append(
            "    re-hit copy calls: loads {} for {} block-layers, saves {} for {}".format(
                *(sum(r.get(f"rehit_{k}", 0) for r in rows) for k in (
                    "load_calls", "block_layers_loaded", "save_calls", "block_layers_saved"))
            )
        )  # fmt: skip
        for context, row in result["per_context"].items():
            lines.append(
                f"    {context} tokens: {row['host_rehits']} re-hits, {_fmt(row['ttft_host_rehit_median_s'])} s vs "
                f"{_fmt(row['ttft_recompute_median_s'])} s = {_fmt(row['recompute_over_host_rehit'], '.2f')}x"
            )
    bandwidth = metrics.get("copy_bandwidth")
    if bandwidth:
        lines.append(
            f"raw copies ({metrics['device']}), {bandwidth['tokens']} tokens ({bandwidth['blocks']} blocks), one step each:"
        )
        for name, row in bandwidth.items():
            if isinstance(row, dict):
                lines.append(
                    f"  {name}: {row['seconds'] * 1e3:.1f} ms, {row['gb_per_s']:.1f} GB/s, {row['copy_calls']} copy "
                    f"calls, queued in {row['queue_seconds'] * 1e3:.1f} ms"
                )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model (default: the default model)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default=None, help="cpu, cuda (default: auto)")
    parser.add_argument(
        "--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[512],
        help="first-turn lengths in tokens, comma list, cycled over the conversations",
    )  # fmt: skip
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=32, help="new tokens of each second turn")
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="device pool size (make it too small)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-offload-gb", type=float, default=1.0, help="the host tier's size")
    parser.add_argument("--overlap-ab", action="store_true", help="also run with every layer waited for first")
    parser.add_argument(
        "--bandwidth-tokens", type=int, default=4096, help="tokens of the raw copy timings at the end (0: skip)"
    )
    parser.add_argument("--copies-only", action="store_true", help="only the raw copy timings, 8B-shaped pools")
    parser.add_argument("--result-dir", default="benchmarks/results")
    parser.add_argument("--result-name", default=None, help="result file name (default: kv_offload-<time>)")
    args = parser.parse_args()
    from tokenmill.bench.results import write_result

    metrics = synthetic_copies(args.bandwidth_tokens, args.device) if args.copies_only else run(args)
    print("\n".join(summary_lines(metrics)))
    path = write_result("kv_offload", vars(args), metrics, out_dir=args.result_dir, name=args.result_name)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
