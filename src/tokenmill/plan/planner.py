"""One capacity and cost plan: a model on a GPU (x tensor parallel) for a workload."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenmill.model.arch import ArchConfig
from tokenmill.plan.calibration import (
    all_reduce_for,
    calibration_for,
    for_format,
    format_factor,
    format_key,
    fp8_compute,
)
from tokenmill.plan.gpu_specs import GpuSpec
from tokenmill.plan.host_cost import host_cost_for
from tokenmill.plan.model_bytes import kv_layout, model_bytes
from tokenmill.plan.roofline import Machine, Workload, model_shape, predict

GPU_MEMORY_UTILIZATION = 0.9  # the engine's default
MAX_NUM_SEQS = 256  # the engine's default on a GPU: the largest batch it runs


@dataclass(frozen=True, slots=True)
class PlanRequest:
    arch: ArchConfig
    gpu: GpuSpec
    input_len: int
    output_len: int
    tensor_parallel: int = 1
    quantization: str | None = None  # fp8 | awq | gptq
    kv_cache_dtype: str = "auto"  # auto | fp8
    concurrency: int | None = None  # None: as many as fit, at most MAX_NUM_SEQS
    max_model_len: int | None = None  # None: the model's limit
    price_per_hour: float | None = None  # $ per GPU-hour


def make_plan(req: PlanRequest) -> dict[str, Any]:
    arch, gpu, tp = req.arch, req.gpu, req.tensor_parallel
    if tp < 1 or arch.num_heads % tp:
        raise ValueError(f"--tp {tp} must divide the model's {arch.num_heads} attention heads")
    if req.input_len < 1 or req.output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    max_model_len = req.max_model_len or arch.max_position_embeddings
    if req.input_len + req.output_len > max_model_len:
        raise ValueError(
            f"--input-len + --output-len = {req.input_len + req.output_len} exceeds max_model_len {max_model_len}"
        )
    dtype_bytes = 4 if gpu.name == "cpu" else 2  # the engine's auto dtype: fp32 on the CPU, bf16 on a GPU
    weights = model_bytes(arch, req.quantization, dtype_bytes)
    kv_bytes = 1 if req.kv_cache_dtype == "fp8" else dtype_bytes
    kv = kv_layout(arch, max_model_len, kv_dtype_bytes=kv_bytes, tensor_parallel=tp)
    cal = calibration_for(gpu)
    weights_per_gpu = weights.total_bytes / tp
    pool = cal.visible_memory_bytes * GPU_MEMORY_UTILIZATION - weights_per_gpu - cal.memory_overhead_bytes
    fits = pool > kv.bytes_per_block * kv.blocks_for(req.input_len + req.output_len)
    num_blocks = max(0, int(pool // kv.bytes_per_block))
    capacity_tokens = (
        kv.groups.capacity_tokens(num_blocks, kv.block_size, kv.max_chunk, max_model_len) if num_blocks else 0
    )
    at_io = kv.max_sequences(num_blocks, req.input_len + req.output_len)
    plan: dict[str, Any] = {
        "model": arch.architecture,
        "gpu": gpu.name,
        "tensor_parallel": tp,
        "quantization": req.quantization,
        "kv_cache_dtype": req.kv_cache_dtype,
        "calibrated": cal.calibrated,
        "calibration_source": cal.source,
        "gpu_source": gpu.source,
        "weights": {
            "total_bytes": weights.total_bytes,
            "per_gpu_bytes": weights_per_gpu,
            "decode_read_bytes_batch1": weights.decode_read_bytes(1),
            "active_params": weights.params_per_token,
            "moe_experts": weights.num_experts,
        },
        "kv_cache": {
            "bytes_per_token": kv.bytes_per_token * tp,
            "bytes_per_token_per_gpu": kv.bytes_per_token,
            "block_size": kv.block_size,
            "num_groups": kv.groups.num_groups,
            "pool_bytes_per_gpu": max(pool, 0.0),
            "num_blocks": num_blocks,
            "capacity_tokens": capacity_tokens,
            "max_model_len": max_model_len,
        },
        "max_concurrency": {
            "at_max_model_len": capacity_tokens / max_model_len,
            "at_input_plus_output": at_io,
        },
        "fits": fits,
    }
    if not fits:
        plan["error"] = (
            f"does not fit: {weights_per_gpu / 1e9:.1f} GB of weights per GPU leave "
            f"{max(pool, 0) / 1e9:.1f} GB for the KV cache of {gpu.name} "
            f"({cal.visible_memory_bytes / 1e9:.0f} GB x {GPU_MEMORY_UTILIZATION}); raise --tp or pass --quantization"
        )
        return plan
    concurrency = req.concurrency or max(1, min(at_io, MAX_NUM_SEQS))
    if concurrency > at_io:
        plan["warning"] = (
            f"concurrency {concurrency} exceeds the {at_io} sequences of {req.input_len + req.output_len} tokens "
            "the KV cache holds: the rest wait (or are preempted); the prediction assumes they all run"
        )
    all_reduce = all_reduce_for(gpu) if tp > 1 else None
    machine = Machine(
        gpu, tp, fp8_compute=fp8_compute(req.quantization, arch), all_reduce=all_reduce and all_reduce.cost
    )
    work = Workload(req.input_len, req.output_len, concurrency)
    key = format_key(req.quantization, arch.moe is not None)
    pred = predict(
        machine,
        weights,
        kv,
        for_format(cal.efficiency, key, gpu.name),
        work,
        model_shape(arch),
    )
    if all_reduce is not None:
        plan["all_reduce"] = {
            "latency_us": 1e6 * all_reduce.cost.latency_s,
            "bus_bytes_per_s": all_reduce.cost.bus_bytes_per_s,
            "source": all_reduce.source,
        }
    if key is not None:
        plan["format_factor"] = {"format": key, "source": format_factor(key, gpu.name).source}
    total_tps = pred.output_tokens_per_s * (req.input_len + req.output_len) / req.output_len
    plan["batch1"] = {
        "roofline_tokens_per_s": pred.batch1_roofline_tokens_per_s,
        "predicted_tokens_per_s": pred.batch1_tokens_per_s,
        "tpot_ms": 1000 / pred.batch1_tokens_per_s,
    }
    host = host_cost_for(gpu.name)
    api_server_s = host.per_stream_s * concurrency
    plan["host_cost"] = {"per_stream_ms": 1000 * host.per_stream_s, "source": host.source}
    plan["at_concurrency"] = {
        "concurrency": concurrency,
        "input_len": req.input_len,
        "output_len": req.output_len,
        "ttft_ms": 1000 * pred.ttft_s,  # the engine's: arrival in the engine to its first token
        # What a streaming client of the API server sees: the engine's plus the host's share
        # (host_cost.py), the API server and the client working through the other streams' chunks.
        "api_server_ttft_ms": 1000 * api_server_s,
        "served_ttft_ms": 1000 * (pred.ttft_s + api_server_s),
        "tpot_ms": 1000 * pred.tpot_s,
        "decode_step_ms": 1000 * pred.step_s,  # the C running requests' decode-only step
        "prefill_step_ms": 1000 * pred.mixed_step_s,  # a step that prefills one prompt among C - 1 decodes
        "e2e_s": pred.ttft_s + (req.output_len - 1) * pred.tpot_s,
        "output_tokens_per_s": pred.output_tokens_per_s,
        "total_tokens_per_s": total_tps,
        "requests_per_s": pred.output_tokens_per_s / req.output_len,
    }
    if req.price_per_hour is not None:
        per_hour = req.price_per_hour * tp
        plan["cost"] = {
            "price_per_hour": per_hour,
            "usd_per_million_output_tokens": per_hour / (pred.output_tokens_per_s * 3600) * 1e6,
            "usd_per_million_total_tokens": per_hour / (total_tps * 3600) * 1e6,
        }
    return plan
