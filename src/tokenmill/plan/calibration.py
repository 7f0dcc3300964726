"""The efficiency factors of the roofline model (roofline.py), fitted from our own benchmark runs.

Per GPU, from two recorded results of Llama-3.1-8B shapes in bf16 (benchmarks/results/):
- the single stream (`bench latency`, 512 in / 256 out): its decode tok/s gives the bandwidth
  efficiency, its TTFT the first-token overhead;
- the offline throughput (`bench throughput`, 512 prompts of 512 in / 256 out, max_num_seqs 256):
  the prefill (FLOP/s) efficiency, solved so the model reproduces the measured output tok/s.
`fit()` redoes this from the files; CALIBRATION holds the result (a test checks the two agree), and
the KV pool's memory overhead at --gpu-memory-utilization 0.9 comes from the pools the engine
reported (BENCHMARKS.md). GPUs without runs of ours borrow the Hopper mean, and say so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenmill.model.arch import ArchConfig
from tokenmill.plan.gpu_specs import GpuSpec
from tokenmill.plan.model_bytes import kv_layout, model_bytes
from tokenmill.plan.roofline import (
    AllReduceCost,
    Efficiency,
    Machine,
    Workload,
    all_reduce_seconds,
    model_shape,
    predict,
    step_cost,
)

GIB = 2**30
# The engine's defaults in those runs.
BENCH_MAX_NUM_SEQS = 256
BENCH_MAX_MODEL_LEN = 4096


@dataclass(frozen=True, slots=True)
class Calibration:
    efficiency: Efficiency
    # Device memory the engine sees (torch's total) and what it keeps beyond weights and the KV
    # pool at --gpu-memory-utilization 0.9 (activations of the profiling forward, CUDA graphs,
    # cuBLAS workspaces).
    visible_memory_bytes: float
    memory_overhead_bytes: float
    source: str
    calibrated: bool = True


# The paged-attention kernel's KV reads as a fraction of the datasheet bandwidth, from the engine's
# own decode-step profiles (`bench`'s profile_decode.py, CUDA graphs, batch 64 at a 512-token
# context: the kernel's summed time against the KV bytes it reads). Two GPUs, two models, one kernel:
# Llama-3.1-8B on an H200 0.571, Qwen3-30B-A3B on an H100 0.569 (fit_attention(); a test checks it).
# The linear layers' weight reads run nearer the peak (0.80-0.84 at batch 1), so KV bytes cost more
# time per byte than weight bytes; a model whose decode step is mostly KV (Gemma 2's 256-wide heads,
# 42 layers) runs further below a single-bandwidth roofline than Llama.
ATTENTION_PROFILES = (
    ("llama-3.1-8b", "H200", "profile-decode-llama-3.1-8b-h200-dc9b65a.json"),
    ("qwen3-30b-a3b", "H100", "profile-decode-qwen3-30b-a3b-h100-8565c7d.json"),
)
ATTENTION_BANDWIDTH_EFFICIENCY = 0.5697  # the mean of the two


def fit_attention(gpu: GpuSpec, arch: ArchConfig, profile_file: Path, batch: int = 64) -> float:
    """The paged-attention kernel's KV read rate / datasheet bandwidth in a decode-step profile's
    `batch` row (the profile decodes at its config's input_len of context)."""
    record = json.loads(profile_file.read_text())
    context = record["config"]["input_len"]
    row = next(r for r in record["metrics"]["rows"] if r["batch"] == batch)
    seconds = sum(k[1] for k in row["graphs_top_kernels"] if k[0] == "_paged_attention_kernel") / 1000
    kv = kv_layout(arch, BENCH_MAX_MODEL_LEN)
    kv_bytes = batch * context * kv.mean_bytes_per_token(context)
    return kv_bytes / seconds / gpu.bandwidth_bytes_per_s


# Fitted by fit() at the commit that added it; the files are in benchmarks/results/.
CALIBRATION: dict[str, Calibration] = {
    "H100": Calibration(
        Efficiency(0.8373, 0.7123, 0.01985, ATTENTION_BANDWIDTH_EFFICIENCY),
        visible_memory_bytes=81559 * 2**20,  # nvidia-smi's 81,559 MiB of an H100 80GB HBM3
        # 0.9 x 81,559 MiB - 16.06 GB weights - 27,229 blocks x 2 MiB (fp8-kv-llama-3.1-8b-h100-engine.json)
        memory_overhead_bytes=3.8e9,
        source="latency-llama-3.1-8b-h100-dc9b65a-rowgemv1.json (185.3 tok/s, TTFT 30.1 ms); "
        "throughput-llama-3.1-8b-h100-seams-b5c6bbd.json (9,400 output tok/s); pool: "
        "fp8-kv-llama-3.1-8b-h100-engine.json",
    ),
    "H200": Calibration(
        Efficiency(0.8020, 0.6538, 0.00373, ATTENTION_BANDWIDTH_EFFICIENCY),
        visible_memory_bytes=139.8 * GIB,  # BENCHMARKS.md, "GPU: NVIDIA H200": 139.8 GiB visible
        # 0.9 x 139.8 GiB - 16.06 GB weights - 55,347 blocks x 2 MiB (BENCHMARKS.md, same section)
        memory_overhead_bytes=3.0e9,
        source="latency-llama-3.1-8b-h200-dc9b65a-rowgemv1-a.json (254.5 tok/s, TTFT 14.9 ms); "
        "throughput-llama-3.1-8b-h200-dc9b65a-rowgemv1.json (10,186 output tok/s); pool: BENCHMARKS.md",
    ),
}


# NVLink all-reduce bus bandwidth: the device notes' 1 GiB NCCL all-reduce on 4 H100s (355 GB/s;
# 329 on 2, 361 on 8); the H200s have the same NVLink generation (NV18) and no reading of their own.
NVLINK_BUS_BYTES_PER_S = 355e9


@dataclass(frozen=True, slots=True)
class AllReduceCalibration:
    cost: AllReduceCost
    source: str


# Fitted by fit_all_reduce() (a test checks the two agree): the latency that makes the model give
# the TP=2 single stream of Llama-3.1-8B shapes, on top of this GPU's one-GPU efficiencies.
ALL_REDUCE: dict[str, AllReduceCalibration] = {
    "H200": AllReduceCalibration(
        AllReduceCost(latency_s=23.67e-6, bus_bytes_per_s=NVLINK_BUS_BYTES_PER_S),
        "multi-gpu-single-llama-3.1-8b-tp2-h200-b614d33.json (287.2 tok/s at TP=2); bus bandwidth: the "
        "device notes' H100 NCCL all-reduce",
    ),
}


def all_reduce_for(gpu: GpuSpec) -> AllReduceCalibration:
    """The GPU's fitted all-reduce cost, else the H200's (the only one measured), saying so."""
    known = ALL_REDUCE.get(gpu.name)
    if known is not None:
        return known
    h200 = ALL_REDUCE["H200"]
    return AllReduceCalibration(
        h200.cost, f"no {gpu.name} tensor-parallel runs of ours: the H200's ({h200.source})"
    )


def fit_all_reduce(gpu: GpuSpec, arch: ArchConfig, latency_file: Path, tensor_parallel: int) -> AllReduceCost:
    """The per-all-reduce latency that makes the model reproduce a tensor-parallel single stream
    (512 in / 256 out) given the GPU's one-GPU efficiencies."""
    measured = _metrics(latency_file)["decode_tokens_per_s"]
    weights = model_bytes(arch)
    kv = kv_layout(arch, BENCH_MAX_MODEL_LEN, tensor_parallel=tensor_parallel)
    eff = CALIBRATION[gpu.name].efficiency
    bus_only = AllReduceCost(0.0, NVLINK_BUS_BYTES_PER_S)
    machine = Machine(gpu, tensor_parallel, fp8_compute=False, all_reduce=bus_only)
    step = step_cost(machine, weights, kv, model_shape(arch), eff, 1, 512 + 256 / 2).total_s
    left = 1 / measured - step - all_reduce_seconds(machine, arch.num_layers, arch.hidden_size, 1)
    return AllReduceCost(max(0.0, left / (2 * arch.num_layers)), NVLINK_BUS_BYTES_PER_S)


@dataclass(frozen=True, slots=True)
class FormatFactor:
    """How much slower than 16-bit dense weights our kernels run a weight format, as multipliers of
    the bandwidth and prefill efficiencies; fitted on one H100 run pair each and applied on every GPU."""

    bandwidth: float
    prefill: float
    source: str


# fit_format() over these files gives the numbers (a test checks they agree).
FORMAT_FACTORS: dict[str, FormatFactor] = {
    "fp8": FormatFactor(
        0.7980, 0.7814, "latency-llama-3.1-8b-fp8-h100.json, throughput-llama-3.1-8b-fp8-h100.json"
    ),
    "int4": FormatFactor(
        0.5912, 0.7512, "latency-llama-3.1-8b-awq-h100.json, throughput-llama-3.1-8b-awq-h100.json"
    ),
    "moe": FormatFactor(
        0.4926, 0.1511, "latency-qwen3-30b-a3b-h100-827f681.json, throughput-qwen3-30b-a3b-h100-827f681.json"
    ),
}


@dataclass(frozen=True, slots=True)
class SameCallRatio:
    """A quantized format against 16-bit weights: the ratio of their fitted bandwidth efficiencies
    on single-stream runs of the same model in the same device call on `gpu` (`files`: the
    quantized run, then the 16-bit one; fit_same_call_ratio).

    For routed experts (QUANTIZED_MOE_FACTORS) it multiplies the 16-bit MoE factor. Prefill keeps
    the 16-bit MoE's factor: the offline model does not reproduce the H200's 16-bit MoE run (its
    fitted prefill efficiency saturates at the bisection's 1.5 on
    `throughput-qwen3-30b-a3b-h200-256-*`), so a prefill ratio fitted against it would mean nothing."""

    bandwidth: float
    gpu: str
    files: tuple[str, str]


# fit_same_call_ratio() over these files gives the numbers (a test checks they agree).
QUANTIZED_MOE_FACTORS: dict[str, SameCallRatio] = {
    "fp8": SameCallRatio(
        0.6264, "H200", ("latency-qwen3-30b-a3b-h200-fp8-experts.json", "latency-qwen3-30b-a3b-h200-bf16-fp8-ab.json")
    ),
    "int4": SameCallRatio(
        0.3352, "H200",
        ("latency-qwen3-30b-a3b-awq-planes-h200.json", "latency-qwen3-30b-a3b-bf16-vs-awq-planes-h200.json"),
    ),  # fmt: skip
}


def fit_same_call_ratio(gpu: GpuSpec, arch: ArchConfig, quantization: str, files: tuple[str, str], results: Path) -> float:
    """The bandwidth ratio of a quantized run's fitted efficiency over the same call's 16-bit run's
    (files in the `results` directory)."""
    quantized_latency, base_latency = files
    bandwidth = fit_bandwidth(gpu, arch, results / quantized_latency, quantization)
    return bandwidth / fit_bandwidth(gpu, arch, results / base_latency)


def _quantized_moe_format(method: str) -> FormatFactor:
    moe, rel = FORMAT_FACTORS["moe"], QUANTIZED_MOE_FACTORS[method]
    return FormatFactor(
        moe.bandwidth * rel.bandwidth, moe.prefill,
        f"{moe.source}; bandwidth times {method} experts over 16-bit ones on the {rel.gpu} ({' over '.join(rel.files)}); "
        "prefill: the 16-bit MoE's (not calibrated for quantized experts)",
    )  # fmt: skip


FORMAT_FACTORS["moe-fp8"] = _quantized_moe_format("fp8")
FORMAT_FACTORS["moe-int4"] = _quantized_moe_format("int4")


# Dense quantized formats on a GPU with a same-call run pair of its own: the single stream's fitted
# bandwidth efficiency of the format over the 16-bit run's (files: the quantized run, then the 16-bit
# one), a multiplier of that GPU's 16-bit bandwidth efficiency in place of the H100 factor (whose
# 0.80 / 0.59 made the H200 plan FP8 ~1.48x and INT4 ~1.85x bf16, measured 1.36x / 1.54x: the
# quantized GEMVs are bound by instructions, not bytes, so they gain less from the H200's
# bandwidth). fit_same_call_ratio() over the files gives the numbers (a test checks they agree).
# Prefill keeps the H100 factor (no offline run of a quantized dense model on another GPU).
QUANTIZED_DENSE_BANDWIDTH: dict[tuple[str, str], SameCallRatio] = {
    ("fp8", "H200"): SameCallRatio(
        0.7324, "H200", ("latency-llama-3.1-8b-fp8-h200-f59197f.json", "latency-llama-3.1-8b-none-h200-f59197f.json")
    ),
    ("int4", "H200"): SameCallRatio(
        0.4898, "H200", ("latency-llama-3.1-8b-awq-h200-f59197f.json", "latency-llama-3.1-8b-none-h200-f59197f.json")
    ),
}


def format_key(quantization: str | None, is_moe: bool) -> str | None:
    if is_moe:
        if quantization is None:
            return "moe"
        return "moe-fp8" if quantization == "fp8" else "moe-int4"
    if quantization == "fp8":
        return "fp8"
    return "int4" if quantization in ("awq", "gptq") else None


def format_factor(key: str, gpu_name: str) -> FormatFactor:
    """The factors of weight format `key` on `gpu_name`: the table's (H100-fitted), with a dense
    quantized format's bandwidth from the GPU's own same-call pair where there is one."""
    factor = FORMAT_FACTORS[key]
    own = QUANTIZED_DENSE_BANDWIDTH.get((key, gpu_name))
    if own is None:
        return factor
    return FormatFactor(
        own.bandwidth, factor.prefill,
        f"bandwidth: {own.files[0]} over the same call's {own.files[1]} ({own.gpu}); prefill: {factor.source}",
    )  # fmt: skip


def for_format(eff: Efficiency, key: str | None, gpu_name: str) -> Efficiency:
    if key is None:
        return eff
    factor = format_factor(key, gpu_name)
    return Efficiency(
        eff.bandwidth * factor.bandwidth,
        eff.prefill * factor.prefill,
        eff.first_token_overhead_s,
        eff.attention_bandwidth,  # the KV cache is 16-bit whatever the weights' format
    )


def calibration_for(gpu: GpuSpec) -> Calibration:
    known = CALIBRATION.get(gpu.name)
    if known is not None:
        return known
    hopper = list(CALIBRATION.values())
    n = len(hopper)
    mean = Efficiency(
        bandwidth=sum(c.efficiency.bandwidth for c in hopper) / n,
        prefill=sum(c.efficiency.prefill for c in hopper) / n,
        first_token_overhead_s=sum(c.efficiency.first_token_overhead_s for c in hopper) / n,
        attention_bandwidth=ATTENTION_BANDWIDTH_EFFICIENCY,
    )
    overhead = sum(c.memory_overhead_bytes for c in hopper) / n
    return Calibration(
        mean, gpu.memory_bytes, overhead,
        source=f"no {gpu.name} runs of ours: the H100 / H200 mean factors", calibrated=False,
    )  # fmt: skip


def _metrics(path: Path) -> dict:
    return json.loads(path.read_text())["metrics"]


def fit_format(
    gpu: GpuSpec,
    arch: ArchConfig,
    quantization: str | None,
    base: Efficiency,
    latency_file: Path,
    throughput_file: Path,
) -> FormatFactor:
    """A weight format's factors: its run pair's fitted efficiencies over the GPU's 16-bit ones."""
    eff = fit(gpu, arch, latency_file, throughput_file, quantization)
    return FormatFactor(
        eff.bandwidth / base.bandwidth,
        eff.prefill / base.prefill,
        f"{latency_file.name}, {throughput_file.name}",
    )


def fp8_compute(quantization: str | None, arch: ArchConfig) -> bool:
    """Whether the linear layers' FLOPs run on FP8 tensor cores: FP8 W8A8 dense models. FP8 routed
    experts are W8A16 (16-bit activations: the experts, most of a MoE model's FLOPs, run in bf16)."""
    return quantization == "fp8" and arch.moe is None


def fit_bandwidth(gpu: GpuSpec, arch: ArchConfig, latency_file: Path, quantization: str | None = None) -> float:
    """The bandwidth efficiency that makes the model reproduce a single stream of `arch` (512 in /
    256 out): the step's time once its KV reads are charged at the attention efficiency."""
    input_len, output_len = 512, 256
    weights = model_bytes(arch, quantization)
    kv = kv_layout(arch, BENCH_MAX_MODEL_LEN)
    context = input_len + output_len / 2
    kv_seconds = context * kv.mean_bytes_per_token(int(context)) / (
        gpu.bandwidth_bytes_per_s * ATTENTION_BANDWIDTH_EFFICIENCY
    )
    linear_read = weights.decode_read_bytes(1) + model_shape(arch).logits_bytes(1)
    step = 1 / _metrics(latency_file)["decode_tokens_per_s"] - kv_seconds
    return linear_read / (step * gpu.bandwidth_bytes_per_s)


def fit(
    gpu: GpuSpec, arch: ArchConfig, latency_file: Path, throughput_file: Path, quantization: str | None = None
) -> Efficiency:
    """The factors that make the model reproduce a single-stream and an offline-throughput run of
    `arch` (512 in / 256 out; 512 prompts at max_num_seqs 256)."""
    latency, throughput = _metrics(latency_file), _metrics(throughput_file)
    input_len, output_len = 512, 256
    machine = Machine(gpu, 1, fp8_compute=fp8_compute(quantization, arch))
    weights = model_bytes(arch, quantization)
    kv = kv_layout(arch, BENCH_MAX_MODEL_LEN)
    shape = model_shape(arch)
    attention = ATTENTION_BANDWIDTH_EFFICIENCY
    bandwidth = fit_bandwidth(gpu, arch, latency_file, quantization)
    eff = Efficiency(bandwidth, 0.5, 0.0, attention)
    offline = Workload(input_len, output_len, BENCH_MAX_NUM_SEQS)
    for _ in range(4):  # the overhead and the prefill efficiency each depend a little on the other
        low, high = 0.01, 1.5  # bisect the prefill efficiency on the offline tok/s
        for _ in range(60):
            mid = (low + high) / 2
            trial = Efficiency(bandwidth, mid, eff.first_token_overhead_s, attention)
            got = predict(machine, weights, kv, trial, offline, shape).output_tokens_per_s
            low, high = (low, mid) if got > throughput["output_tokens_per_s"] else (mid, high)
        prefill = (low + high) / 2
        single = predict(
            machine,
            weights,
            kv,
            Efficiency(bandwidth, prefill, 0.0, attention),
            Workload(input_len, output_len, 1),
            shape,
        )
        eff = Efficiency(bandwidth, prefill, max(0.0, latency["ttft_s"] - single.prefill_s), attention)
    return eff
