"""`tokenmill bench latency`: one stream, prefill then decode, against the memory-bandwidth roofline.

roofline_fraction = decode tok/s / (device-to-device copy bandwidth / bytes read per decode step),
where the bandwidth counts bytes read and written (as the device notes do) and a decode step
reads every weight once plus the KV cache of the context so far (averaged over the decode); of a
mixture-of-experts model, only the top_k routed experts per layer (the active parameters).
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenmill.core.runner_facts import RunnerFacts


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.args import EngineArgs

    EngineArgs.add_cli_args(parser)
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=256, help="tokens decoded (EOS ignored)")
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs; the fastest is reported")
    parser.add_argument(
        "--baseline",
        choices=["none", "hf-generate"],
        default="none",
        help="also time transformers' generate() on the same weights and prompt",
    )
    parser.add_argument(
        "--save-result", action=argparse.BooleanOptionalAction, default=True, help="write the result JSON"
    )
    parser.add_argument("--result-dir", default="benchmarks/results", help="directory of the result JSON")
    parser.add_argument(
        "--result-name", default=None, help="file name of the result JSON (default: <benchmark>-<UTC time>)"
    )


def copy_bandwidth(device: str) -> float:
    """Bytes per second a large device-to-device copy moves, counting bytes read and written (the
    workers measure theirs with the same function; imported here lazily: the CLI that builds the
    server imports this module, and the API server process imports no worker code)."""
    from tokenmill.worker.runner_facts import copy_bandwidth as measure

    return measure(device)


def one_stream(llm: Any, prompt: list[int], output_len: int) -> dict[str, float]:
    """Prefill and decode timings of one request, driving the engine step by step."""
    import torch

    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    req = llm.input_processor.make_request("latency", prompt, params)
    # A tensor-parallel engine's GPUs belong to its workers: this process has no CUDA work to wait for.
    in_process_cuda = llm.info.device.startswith("cuda") and torch.cuda.is_initialized()
    sync = torch.cuda.synchronize if in_process_cuda else (lambda: None)
    sync()
    started = time.perf_counter()
    llm.engine.add_request(req)
    first_token_at = None
    num_tokens = 0
    while llm.engine.has_work():
        for out in llm.engine.step():
            num_tokens += len(out.new_token_ids)
            if first_token_at is None and out.new_token_ids:
                first_token_at = time.perf_counter()
    finished_at = time.perf_counter()
    assert first_token_at is not None and num_tokens == output_len, (num_tokens, output_len)
    decode_s = finished_at - first_token_at
    return {
        "ttft_s": first_token_at - started,
        "decode_s": decode_s,
        "decode_tokens_per_s": (output_len - 1) / decode_s,
        "tpot_ms": 1000 * decode_s / (output_len - 1),
    }


def decode_bytes_per_step(llm: Any, input_len: int, output_len: int) -> tuple[float, float]:
    """(weight bytes, mean KV bytes) one decode step reads, summed over the tensor-parallel ranks.

    Every weight matrix is read once; the input embedding table is not (a step gathers one row
    per token), so an untied embedding is left out rather than flattering the fraction. Of a
    mixture-of-experts layer's routed experts one token reads its top_k: the active parameters
    (the router, attention, norms, dense and shared-expert MLPs are read whole). With tensor
    parallelism each rank reads its shard; what ranks replicate (norms, KV heads shared by
    several ranks) every one of them reads, so it counts once per rank.
    """
    return step_bytes(llm.engine.executor.describe_runners(), input_len, output_len)


def step_bytes(facts: list[RunnerFacts], input_len: int, output_len: int) -> tuple[float, float]:
    """decode_bytes_per_step from the ranks' facts."""
    mean_context = input_len + output_len / 2
    weight_bytes = sum(f.decode_weight_bytes for f in facts)
    kv_bytes = sum(f.kv_bytes_per_token for f in facts) * mean_context
    return float(weight_bytes), float(kv_bytes)


def aggregate_bandwidth(llm: Any) -> tuple[list[RunnerFacts], list[float], float]:
    """(the ranks' facts, each device's copy bandwidth, their sum: the roofline's bandwidth).

    GPUs: each rank measures its own device (at the same time: they do not share memory). CPU
    ranks share one memory system, so it is measured once, here, with the workers idle."""
    executor = llm.engine.executor
    if not llm.info.device.startswith("cuda"):
        bandwidth = copy_bandwidth("cpu")
        return executor.describe_runners(), [bandwidth], bandwidth
    facts = executor.describe_runners(measure_bandwidth=True)
    per_device = {f.device: f.copy_bandwidth_bytes_per_s for f in facts}  # ranks sharing a GPU count it once
    if any(value is None for value in per_device.values()):
        raise RuntimeError(f"a rank did not measure its copy bandwidth: {per_device}")
    values = [float(v) for v in per_device.values()]  # type: ignore[arg-type]
    return facts, values, sum(values)


def embedding_bytes(llm: Any) -> float:
    """Bytes of an untied input embedding table over the ranks (0 when tied: lm_head reads it anyway)."""
    return sum(f.embedding_bytes for f in llm.engine.executor.describe_runners())


def main(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from tokenmill.args import EngineArgs
    from tokenmill.bench.results import engine_options, write_result
    from tokenmill.bench.spec_decode import format_spec_decode, spec_decode_summary, spec_decode_totals
    from tokenmill.engine.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**engine_args.as_kwargs())
    engine_config = llm.config  # recorded in the result; the baseline below deletes llm
    rng = np.random.default_rng(args.seed)
    # A fresh prompt for every run: a repeated one would hit the prefix cache and TTFT would time
    # a one-block prefill. The baseline below gets the last run's prompt.
    prompts = rng.integers(100, llm.info.vocab_size, size=(args.num_iters + 1, args.input_len)).tolist()
    one_stream(llm, prompts[0], 8)  # warm-up
    spec_before = spec_decode_totals(llm.engine.get_stats())
    runs = [one_stream(llm, prompt, args.output_len) for prompt in prompts[1:]]
    # Over every timed run (the engine counts per step, not per run); None without speculation.
    spec_decode = spec_decode_summary(spec_before, spec_decode_totals(llm.engine.get_stats()))
    prompt = prompts[-1]
    best = max(runs, key=lambda r: r["decode_tokens_per_s"])
    facts, per_device, bandwidth = aggregate_bandwidth(llm)
    weight_bytes, kv_bytes = step_bytes(facts, args.input_len, args.output_len)
    untied_embedding = sum(f.embedding_bytes for f in facts)
    roofline_tps = bandwidth / (weight_bytes + kv_bytes)
    metrics: dict[str, Any] = {
        **best,
        "tensor_parallel_size": len(facts),
        "cuda_graphs": all(f.cuda_graphs for f in facts),
        "runs": runs,
        # The roofline's bandwidth: the sum over the ranks' devices (N x one GPU's under tensor
        # parallelism); ranks that share a memory (CPU) share one measurement.
        "copy_bandwidth_bytes_per_s": bandwidth,
        "per_device_copy_bandwidth_bytes_per_s": per_device,
        "device_names": sorted({f.device_name for f in facts}),
        "weight_bytes": weight_bytes,  # summed over the ranks
        "per_rank_weight_bytes": [f.decode_weight_bytes for f in facts],
        # routed experts a one-token step does not read (mixture-of-experts models; else 0)
        "unread_expert_weight_bytes": sum(f.unread_expert_bytes for f in facts),
        "mean_kv_bytes_per_step": kv_bytes,
        "roofline_tokens_per_s": roofline_tps,
        "roofline_fraction": best["decode_tokens_per_s"] / roofline_tps,
        # Counting the input embedding table as read too (it is not: a step gathers one row), as
        # the reference figures in the GPU issue were taken; for comparison with those only.
        "roofline_fraction_all_weights": best["decode_tokens_per_s"]
        * (weight_bytes + untied_embedding + kv_bytes)
        / bandwidth,
        # This process's peak resident memory so far (loading included; the engine runs in it on
        # the CPU): what a machine needs to load and run the model.
        "host_peak_rss_bytes": peak_rss_bytes(),
    }
    if spec_decode is not None:
        metrics["spec_decode"] = spec_decode
    print(
        f"single stream: TTFT {best['ttft_s'] * 1000:.1f} ms, decode {best['decode_tokens_per_s']:.1f} tok/s "
        f"(TPOT {best['tpot_ms']:.2f} ms); roofline {roofline_tps:.1f} tok/s at {bandwidth / 1e12:.2f} TB/s "
        f"-> roofline_fraction {metrics['roofline_fraction']:.3f}"
    )
    if spec_decode is not None:
        print(format_spec_decode(spec_decode))
    # Ends tensor-parallel workers too (an engine left to the garbage collector would hang in
    # ZMQ's context teardown); frees the KV pool and graphs, which would leave transformers no room.
    llm.shutdown()
    if args.baseline == "hf-generate":
        import torch

        from tokenmill.bench.hf_baseline import load_hf_model

        device, dtype = llm.info.device, llm.info.dtype
        weights = llm.resolved.path  # the very files tokenmill ran (a Hub id's snapshot, not its branch)
        del llm
        hf = load_hf_model(weights, args.load_format, device, dtype)
        ids = torch.tensor([prompt], device=device)
        for attempt in range(2):  # the first is a warm-up
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.output_len if attempt else 8,
                    min_new_tokens=args.output_len if attempt else 8,
                    do_sample=False,
                    pad_token_id=0,
                )
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
        hf_tps = (out.shape[1] - ids.shape[1]) / elapsed
        metrics["baseline_hf_generate_tokens_per_s"] = hf_tps
        metrics["baseline_hf_roofline_fraction"] = hf_tps / roofline_tps
        metrics["speedup_vs_transformers"] = best["decode_tokens_per_s"] / hf_tps
        print(
            f"transformers generate: {hf_tps:.1f} tok/s (roofline_fraction {hf_tps / roofline_tps:.3f}, prefill included)"
        )
    config = {
        "model": args.model,
        "load_format": args.load_format,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tensor_parallel_size": engine_config.parallel.tensor_parallel_size,
        **engine_options(engine_args, engine_config),
    }
    if args.save_result:
        print(
            f"wrote {write_result('latency', config, metrics, out_dir=args.result_dir, name=args.result_name)}"
        )
    return metrics


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
