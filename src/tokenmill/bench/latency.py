"""`tokenmill bench latency`: one stream, prefill then decode, against the memory-bandwidth roofline.

roofline_fraction = decode tok/s / (device-to-device copy bandwidth / bytes read per decode step),
where the bandwidth counts bytes read and written (as the device notes do) and a decode step
reads every weight once plus the KV cache of the context so far (averaged over the decode); of a
mixture-of-experts model, only the top_k routed experts per layer (the active parameters).
"""

from __future__ import annotations

import argparse
import time
from typing import Any


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
    """Bytes per second a large device-to-device copy moves, counting bytes read and written."""
    import torch

    if not device.startswith("cuda"):
        n = 256 * 2**20
        src = torch.empty(n, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)
        started = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        return 2 * n * 5 / (time.perf_counter() - started)
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 10 / seconds


def one_stream(llm: Any, prompt: list[int], output_len: int) -> dict[str, float]:
    """Prefill and decode timings of one request, driving the engine step by step."""
    import torch

    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    req = llm.input_processor.make_request("latency", prompt, params)
    sync = torch.cuda.synchronize if llm.info.device.startswith("cuda") else (lambda: None)
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
    """(weight bytes, mean KV bytes) read by one decode step.

    Every weight matrix is read once; the input embedding table is not (a step gathers one row
    per token), so an untied embedding is left out rather than flattering the fraction. Of a
    mixture-of-experts layer's routed experts one token reads its top_k: the active parameters
    (the router, attention, norms, dense and shared-expert MLPs are read whole).
    """
    from tokenmill.model.layers.moe import unread_expert_bytes
    from tokenmill.model.layers.quantized_method import kernel_weight_bytes

    model = llm.engine.runner.model
    weight_bytes = (
        sum(p.numel() * p.element_size() for p in model.parameters())
        + kernel_weight_bytes(model)  # quantized layers' FP8 / INT4 tensors, scales and zeros
        - embedding_bytes(llm)
        - unread_expert_bytes(model)
    )
    arch = llm.resolved.arch
    itemsize = llm.engine.runner.kv_cache_tensors[0].element_size()  # the cache's own dtype (fp8: 1 byte)
    kv_per_token = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * itemsize
    mean_context = input_len + output_len / 2
    return float(weight_bytes), float(kv_per_token * mean_context)


def embedding_bytes(llm: Any) -> float:
    """Bytes of an untied input embedding table (0 when tied: lm_head reads it anyway)."""
    model = llm.engine.runner.model
    if model.lm_head.weight_is_shared:
        return 0.0
    return float(model.embed_tokens.numel() * model.embed_tokens.element_size())


def main(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    from tokenmill.args import EngineArgs
    from tokenmill.bench.results import engine_options, write_result
    from tokenmill.bench.spec_decode import format_spec_decode, spec_decode_summary, spec_decode_totals
    from tokenmill.engine.llm import LLM
    from tokenmill.model.layers.moe import unread_expert_bytes

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
    bandwidth = copy_bandwidth(llm.info.device)
    weight_bytes, kv_bytes = decode_bytes_per_step(llm, args.input_len, args.output_len)
    roofline_tps = bandwidth / (weight_bytes + kv_bytes)
    metrics: dict[str, Any] = {
        **best,
        "cuda_graphs": llm.engine.runner.graph_runner is not None,
        "runs": runs,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "weight_bytes": weight_bytes,
        # routed experts a one-token step does not read (mixture-of-experts models; else 0)
        "unread_expert_weight_bytes": float(unread_expert_bytes(llm.engine.runner.model)),
        "mean_kv_bytes_per_step": kv_bytes,
        "roofline_tokens_per_s": roofline_tps,
        "roofline_fraction": best["decode_tokens_per_s"] / roofline_tps,
        # Counting the input embedding table as read too (it is not: a step gathers one row), as
        # the reference figures in the GPU issue were taken; for comparison with those only.
        "roofline_fraction_all_weights": best["decode_tokens_per_s"]
        * (weight_bytes + embedding_bytes(llm) + kv_bytes)
        / bandwidth,
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
    if args.baseline == "hf-generate":
        import torch

        from tokenmill.bench.hf_baseline import load_hf_model

        device, dtype = llm.info.device, llm.info.dtype
        weights = llm.resolved.path  # the very files tokenmill ran (a Hub id's snapshot, not its branch)
        llm.engine.runner.release()  # the KV pool and graphs would leave transformers no room
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
        **engine_options(engine_args, engine_config),
    }
    if args.save_result:
        print(
            f"wrote {write_result('latency', config, metrics, out_dir=args.result_dir, name=args.result_name)}"
        )
    return metrics
