"""`tokenmill plan MODEL --gpu ... --input-len I --output-len O`: the report (docs/PLANNER.md)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenmill.model.arch import ArchConfig
from tokenmill.plan.gpu_specs import GPUS, gpu_spec
from tokenmill.plan.model_bytes import QUANTIZATIONS
from tokenmill.plan.planner import PlanRequest, make_plan

DESCRIPTION = (
    "Weight and KV bytes, maximum concurrency, the batch-1 roofline, and at a concurrency the TTFT "
    "(the engine's, and streamed through the API server: plus its time per stream in flight), TPOT, "
    "tok/s and $ per million tokens, from a roofline model calibrated by our own benchmark runs. "
    "Outputs and errors: docs/PLANNER.md."
)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a model directory or .gguf file, a Hub id in the cache, or a config.json")
    parser.add_argument("--gpu", required=True, help=f"one of {', '.join(GPUS)}")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None, help="weights (default: the checkpoint's, else 16-bit)")
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="KV cache: auto (the weights' 16 bits) or fp8"
    )
    parser.add_argument("--input-len", type=int, required=True, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, required=True, help="generated tokens per request")
    parser.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: as many as fit, at most 256)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's limit")
    parser.add_argument("--price-per-hour", type=float, default=None, help="$ per GPU-hour, for $ per million tokens")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def read_arch(model: str, quantization: str | None) -> tuple[ArchConfig, str | None]:
    """The architecture and the quantization (--quantization, else the checkpoint's) without weights."""
    path = Path(model)
    if path.is_file() and path.suffix == ".json":
        from tokenmill.model.loader.quant_config import resolve_quantization

        hf_config = json.loads(path.read_text())
        spec = resolve_quantization(hf_config, quantization, model, dummy=True)
        arch = ArchConfig.from_hf_config(hf_config)
    else:
        from tokenmill.config import ModelConfig
        from tokenmill.model.resolve import resolve_model

        # dummy: a directory with only a config.json is enough (no weight file is opened)
        resolved = resolve_model(ModelConfig(model=model, quantization=quantization, load_format="dummy"))
        arch, spec = resolved.arch, resolved.quantization
    if spec is None:
        return arch, None
    if spec.method in QUANTIZATIONS:
        return arch, spec.method
    return arch, "fp8" if spec.scheme == "fp8_w8a8" else "gptq"  # compressed-tensors: by its scheme


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def render(plan: dict) -> str:
    w, kv, mc = plan["weights"], plan["kv_cache"], plan["max_concurrency"]
    lines = [
        f"{plan['model']} on {plan['tensor_parallel']} x {plan['gpu']}, weights {plan['quantization'] or '16-bit'}, "
        f"KV cache {plan['kv_cache_dtype']}",
        f"  weights: {_gb(w['total_bytes'])} ({_gb(w['per_gpu_bytes'])} per GPU), "
        f"{w['active_params'] / 1e9:.2f} B active params, a batch-1 decode step reads {_gb(w['decode_read_bytes_batch1'])}",
        f"  KV cache: {kv['bytes_per_token'] / 1024:.1f} KiB per token, pool {_gb(kv['pool_bytes_per_gpu'])} per GPU = "
        f"{kv['num_blocks']:,} blocks of {kv['block_size']} = {kv['capacity_tokens']:,} tokens",
        f"  max concurrency: {mc['at_max_model_len']:.2f}x at max_model_len {kv['max_model_len']}, "
        f"{mc['at_input_plus_output']:,} sequences of input + output tokens",
    ]
    if "error" in plan:
        return "\n".join([*lines, f"  {plan['error']}"])
    b, c = plan["batch1"], plan["at_concurrency"]
    lines += [
        f"  batch 1: roofline {b['roofline_tokens_per_s']:.1f} tok/s, predicted {b['predicted_tokens_per_s']:.1f} tok/s "
        f"(TPOT {b['tpot_ms']:.2f} ms)",
        f"  at concurrency {c['concurrency']} ({c['input_len']} in / {c['output_len']} out): TTFT {c['ttft_ms']:.0f} ms "
        f"in the engine ({c['served_ttft_ms']:.0f} ms streamed through the API server), "
        f"TPOT {c['tpot_ms']:.2f} ms, {c['output_tokens_per_s']:,.0f} output tok/s "
        f"({c['total_tokens_per_s']:,.0f} total), {c['requests_per_s']:.2f} req/s",
    ]
    if "cost" in plan:
        cost = plan["cost"]
        lines.append(
            f"  cost at ${cost['price_per_hour']:.2f}/h: ${cost['usd_per_million_output_tokens']:.3f} per million "
            f"output tokens, ${cost['usd_per_million_total_tokens']:.3f} per million tokens in + out"
        )
    if "warning" in plan:
        lines.append(f"  warning: {plan['warning']}")
    calibration = "calibrated by" if plan["calibrated"] else "UNCALIBRATED,"
    lines.append(f"  ({calibration} {plan['calibration_source']}; GPU: {plan['gpu_source']})")
    if "format_factor" in plan:
        factor = plan["format_factor"]
        lines.append(f"  (weight format {factor['format']}: {factor['source']})")
    host = plan["host_cost"]
    lines.append(f"  (API server: {host['per_stream_ms']:.2f} ms of TTFT per stream in flight: {host['source']})")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    arch, quantization = read_arch(args.model, args.quantization)
    plan = make_plan(
        PlanRequest(
            arch=arch,
            gpu=gpu_spec(args.gpu),
            input_len=args.input_len,
            output_len=args.output_len,
            tensor_parallel=args.tp,
            quantization=quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            concurrency=args.concurrency,
            max_model_len=args.max_model_len,
            price_per_hour=args.price_per_hour,
        )
    )
    print(json.dumps(plan, indent=2) if args.json else render(plan))
    return 0 if plan["fits"] else 1
