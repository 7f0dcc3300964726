"""`tokenmill bench throughput`: offline, in-process throughput with random prompts.

Optionally measures a `transformers` baseline in the same run on the same weights, so the result
is a ratio taken on one machine at one time. `--lora-adapters N` spreads the prompts over N dummy
LoRA adapters (bench/lora_workload.py); benchmarks/lora_gpu.sh compares that with the base model.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from tokenmill.args import EngineArgs
    from tokenmill.bench import lora_workload

    EngineArgs.add_cli_args(parser)
    lora_workload.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64, help="random prompts, all submitted at once")
    parser.add_argument("--input-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument(
        "--output-len", type=int, default=128, help="tokens generated per prompt (EOS ignored)"
    )
    parser.add_argument(
        "--baseline",
        choices=["none", "hf-generate", "hf-generate-batch"],
        default="none",
        help="also measure transformers in the same run: hf-generate = generate() at batch 1 and padded "
        "batch 8 (CPU baseline); hf-generate-batch = continuous batching generate_batch with paged|sdpa (GPU)",
    )
    parser.add_argument(
        "--baseline-num-prompts", type=int, default=None, help="prompts for the baseline (default: all)"
    )
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first a short untimed run that compiles the kernels the timed one needs",
    )
    parser.add_argument(
        "--save-result", action=argparse.BooleanOptionalAction, default=True, help="write the result JSON"
    )
    parser.add_argument("--result-dir", default="benchmarks/results", help="directory of the result JSON")
    parser.add_argument(
        "--result-name", default=None, help="file name of the result JSON (default: <benchmark>-<UTC time>)"
    )


def random_prompts(num: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    # Stay clear of the lowest ids, where special tokens usually live.
    return rng.integers(100, vocab_size, size=(num, input_len)).tolist()


def run_tokenmill(
    llm: Any,
    prompts: list[list[int]],
    output_len: int,
    use_tqdm: bool = True,
    lora_requests: list[Any] | None = None,
) -> dict[str, float]:
    """Generate `output_len` tokens for each prompt (prompt i with lora_requests[i], if given)."""
    from tokenmill.sampling_params import SamplingParams

    # Without tokenizer files (dummy weights at a real model's shapes) there is nothing to detokenize.
    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=llm.tokenizer is not None
    )
    started = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=use_tqdm, lora_request=lora_requests
    )
    elapsed = time.perf_counter() - started
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(p) for p in prompts)
    return {
        "elapsed_s": elapsed,
        "num_requests": len(prompts),
        "output_tokens": num_out,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_out + num_in) / elapsed,
        "requests_per_s": len(prompts) / elapsed,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.args import EngineArgs
    from tokenmill.bench import lora_workload
    from tokenmill.bench.results import engine_options, write_result
    from tokenmill.bench.spec_decode import format_spec_decode, spec_decode_summary, spec_decode_totals
    from tokenmill.engine.llm import LLM

    lora = lora_workload.resolve(args)  # fills the engine's LoRA options in args
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**engine_args.as_kwargs())
    engine_config = llm.config  # recorded in the result; the baseline below deletes llm
    prompts = random_prompts(args.num_prompts, args.input_len, llm.info.vocab_size, seed=args.seed)
    adapters = None
    if lora is not None:
        adapters = lora_workload.AdapterSet(lora, llm.resolved.arch, args.lora_dir, args.model)
    try:
        per_prompt = adapters.per_prompt(len(prompts)) if adapters is not None else None
        if args.warmup:
            # Enough prompts for a mixed prefill + decode step: compiles the kernel variants the run
            # needs; with adapters, enough to meet each one, so all are in host memory before the timing.
            count = min(len(prompts), max(32, lora.adapters if lora is not None else 0))
            warm_loras = per_prompt[:count] if per_prompt is not None else None
            run_tokenmill(llm, prompts[:count], 8, use_tqdm=False, lora_requests=warm_loras)
        spec_before = spec_decode_totals(llm.engine.get_stats())
        lora_before = lora_workload.lora_counters(llm)
        metrics: dict[str, Any] = run_tokenmill(llm, prompts, args.output_len, lora_requests=per_prompt)
        lora_after = lora_workload.lora_counters(llm)
    finally:
        if adapters is not None:
            adapters.close()
    spec_decode = spec_decode_summary(spec_before, spec_decode_totals(llm.engine.get_stats()))
    # Per device, so that tensor-parallel runs compare with one device at equal hardware.
    devices = engine_config.parallel.tensor_parallel_size
    metrics["tensor_parallel_size"] = devices
    metrics["output_tokens_per_s_per_device"] = metrics["output_tokens_per_s"] / devices
    metrics["total_tokens_per_s_per_device"] = metrics["total_tokens_per_s"] / devices
    print(
        f"tokenmill: {metrics['output_tokens_per_s']:.1f} output tok/s, {metrics['total_tokens_per_s']:.1f} total tok/s "
        f"({metrics['num_requests']} requests in {metrics['elapsed_s']:.1f} s)"
    )
    if spec_decode is not None:  # None without speculation
        metrics["spec_decode"] = spec_decode
        print(format_spec_decode(spec_decode))
    if lora is not None and lora_before is not None and lora_after is not None:
        # Loads during the timed run: host loads should be 0 (all adapters warmed up); slot loads
        # count the adapter swaps when there are more adapters than slots.
        metrics["lora"] = {key: lora_after[key] - lora_before[key] for key in lora_after}
        print(f"LoRA during the timed run: {metrics['lora']}")

    llm.shutdown()  # ends tensor-parallel workers; frees the KV pool, graphs and weights for the baseline
    if args.baseline != "none":
        from tokenmill.bench import hf_baseline

        baseline_prompts = prompts[: args.baseline_num_prompts or len(prompts)]
        device = llm.info.device
        dtype = llm.info.dtype
        weights = llm.resolved.path  # the very files tokenmill ran (a Hub id's snapshot, not its branch)
        del llm
        if args.baseline == "hf-generate":
            base = hf_baseline.measure_generate(
                weights, args.load_format, baseline_prompts, args.output_len, device, dtype
            )
        else:
            base = hf_baseline.measure_generate_batch(
                weights, args.load_format, baseline_prompts, args.output_len, device, dtype
            )
        metrics["baseline"] = base
        best = max(v["output_tokens_per_s"] for v in base.values())
        metrics["best_baseline_output_tokens_per_s"] = best
        metrics["speedup_vs_transformers"] = metrics["output_tokens_per_s"] / best
        for name, value in base.items():
            print(f"transformers {name}: {value['output_tokens_per_s']:.1f} output tok/s")
        print(f"speedup vs the best transformers figure: {metrics['speedup_vs_transformers']:.2f}x")

    config = {
        "model": args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
        "load_format": args.load_format,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "baseline": args.baseline,
        "tensor_parallel_size": engine_config.parallel.tensor_parallel_size,
        "baseline_num_prompts": len(prompts[: args.baseline_num_prompts or len(prompts)])
        if args.baseline != "none"
        else 0,
        **engine_options(engine_args, engine_config),
    }
    if lora is not None:
        config["lora"] = lora.config_block()
    if args.save_result:
        path = write_result("throughput", config, metrics, out_dir=args.result_dir, name=args.result_name)
        print(f"wrote {path}")
    else:
        print(json.dumps({"config": config, "metrics": metrics}, indent=2, default=str))
    return metrics
