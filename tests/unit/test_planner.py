"""`tokenmill plan`: the byte math on tiny configs and against a real load, the recorded weight bytes
and KV pools, the calibration table against the result files it was fitted from, and predictions
within PREDICTION_TOLERANCE of our recorded H100 / H200 runs (calibration points and held-out ones)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.core.kv_cache_groups import plan_kv_cache_groups
from tokenmill.model.arch import ArchConfig
from tokenmill.plan import calibration
from tokenmill.plan.cli import main as plan_main
from tokenmill.plan.gpu_specs import GPUS, gpu_spec
from tokenmill.plan.host_cost import (
    ENGINE_STAGES,
    HOST_COST,
    HOST_STAGES,
    fit_host_cost,
    littles_law_concurrency,
    stage_sum_ms,
)
from tokenmill.plan.model_bytes import kv_layout, model_bytes
from tokenmill.plan.planner import PlanRequest, make_plan

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = ROOT / "benchmarks" / "configs"
PREDICTION_TOLERANCE = 0.25  # the stated error of the planner's predictions


def bench_arch(name: str) -> ArchConfig:
    return ArchConfig.from_hf_config(json.loads((CONFIGS / name / "config.json").read_text()))


def metrics(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())["metrics"]


def tiny(**overrides) -> ArchConfig:
    cfg = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    } | overrides  # fmt: skip
    return ArchConfig.from_hf_config(cfg)


# ----------------------------------------------------------------------------- byte math


def test_weight_and_kv_bytes_of_a_tiny_llama_by_hand():
    arch = tiny()
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # q k v, o, gate up down, 2 norms
    weights = model_bytes(arch)
    assert weights.dense_read_bytes == 2 * (2 * per_layer + 100 * 64 + 64)  # + lm_head + final norm
    assert weights.embedding_bytes == 2 * 100 * 64
    assert weights.total_bytes == weights.dense_read_bytes + weights.embedding_bytes
    tied = model_bytes(tiny(tie_word_embeddings=True))
    assert tied.embedding_bytes == 0 and tied.total_bytes == weights.dense_read_bytes
    kv = kv_layout(arch, 256, block_size=16)
    assert kv.bytes_per_token == 2 * 2 * 2 * 16 * 2  # layers x (K, V) x kv heads x head_dim x bf16
    assert kv.bytes_per_block == 16 * kv.bytes_per_token
    assert kv_layout(arch, 256, kv_dtype_bytes=1).bytes_per_token == kv.bytes_per_token // 2  # fp8 KV
    assert kv_layout(arch, 256, tensor_parallel=2).bytes_per_token == kv.bytes_per_token // 2  # half the heads a rank
    assert kv.max_sequences(num_blocks=100, num_tokens=33) == 100 // 3


def test_quantized_linear_bytes_are_smaller_by_their_format():
    arch = tiny(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)
    bf16, fp8, int4 = (model_bytes(arch, q) for q in (None, "fp8", "awq"))
    linear = 2 * (256 * 256 * 4 + 3 * 256 * 512)  # two layers of q k v o (all 256 x 256) and the MLP
    rows = 2 * (256 * 4 + 512 * 2 + 256)
    assert bf16.dense_read_bytes - fp8.dense_read_bytes == linear * 2 - (linear + 8 * rows)
    groups = 2 * (4 * 2 * 256 + 2 * 2 * 512 + 4 * 256)  # per layer: groups (in / 128) x output rows of each matrix
    assert bf16.dense_read_bytes - int4.dense_read_bytes == linear * 2 - (linear / 2 + 4 * groups + rows)


def test_sliding_window_layers_hold_fewer_blocks():
    """Half the layers slide (window 32): a long sequence holds about half the KV of a full model
    (the engine's own block math: its peak during a prefill chunk of max_num_batched_tokens)."""
    arch = tiny(num_hidden_layers=4, max_position_embeddings=2048)
    sliding = dataclasses.replace(arch, sliding_windows=(32, None, 32, None))
    full = kv_layout(arch, 2048, max_num_batched_tokens=64)
    half = kv_layout(sliding, 2048, max_num_batched_tokens=64)
    groups = plan_kv_cache_groups(4, (32, None, 32, None), 2048)
    assert half.groups == groups and half.bytes_per_block == groups.num_tensors * 16 * half.bytes_per_token_per_layer
    assert half.blocks_for(2048) == groups.blocks_for_one_sequence(2048, 16, 64)
    assert half.mean_bytes_per_token(2048) < 0.6 * full.mean_bytes_per_token(2048)
    assert full.mean_bytes_per_token(2048) == full.bytes_per_token


def test_moe_reads_the_experts_its_tokens_pick():
    arch = bench_arch("qwen3-30b-a3b")
    weights = model_bytes(arch)
    assert weights.num_experts == 128 and weights.top_k == 8
    recorded = metrics("latency-qwen3-30b-a3b-h100-827f681.json")
    assert weights.decode_read_bytes(1) == pytest.approx(recorded["weight_bytes"], rel=1e-3)
    held_not_read = weights.total_bytes - weights.embedding_bytes - weights.decode_read_bytes(1)
    assert held_not_read == pytest.approx(recorded["unread_expert_weight_bytes"], rel=1e-3)
    assert weights.decode_read_bytes(1) < weights.decode_read_bytes(8) < weights.decode_read_bytes(512)
    assert weights.decode_read_bytes(10_000) == pytest.approx(weights.total_bytes - weights.embedding_bytes, rel=1e-6)
    assert weights.params_per_token == pytest.approx(3.04e9, rel=0.02)  # "30B-A3B": ~3 B active


@pytest.mark.parametrize(
    ("config", "quantization", "result"),
    [
        ("llama-3.1-8b", None, "latency-llama-3.1-8b-h200-dc9b65a-rowgemv1-a.json"),
        ("llama-3.1-8b", "fp8", "latency-llama-3.1-8b-fp8-h100.json"),
        ("llama-3.1-8b", "awq", "latency-llama-3.1-8b-awq-h100.json"),
        ("gemma-2-9b", None, "latency-gemma-2-9b-h100-47868d2.json"),
    ],
)
def test_decode_read_bytes_match_what_bench_latency_measured_on_the_loaded_model(config, quantization, result):
    weights = model_bytes(bench_arch(config), quantization)
    assert weights.decode_read_bytes(1) == pytest.approx(metrics(result)["weight_bytes"], rel=1e-3)


def test_the_kv_layout_matches_a_real_load(tiny_llama_dir):
    """The engine's own pool (CPU, fp32, kv_cache_memory bytes) holds the blocks the planner computes."""
    from tokenmill.engine.llm import LLM

    budget = 3_000_000
    llm = LLM(str(tiny_llama_dir), device="cpu", max_model_len=128, block_size=4, kv_cache_memory=budget)
    arch = llm.resolved.arch
    layout = kv_layout(arch, 128, kv_dtype_bytes=4, block_size=4)
    assert llm.info.num_kv_blocks == budget // layout.bytes_per_block
    # Every tensor of the checkpoint the planner counts (its safetensors header: fp32, tied embeddings).
    stored = 0
    for file in Path(tiny_llama_dir).glob("*.safetensors"):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        stored += sum(t["data_offsets"][1] - t["data_offsets"][0] for k, t in header.items() if k != "__metadata__")
    assert stored == model_bytes(arch, dtype_bytes=4).total_bytes


# ----------------------------------------------------------------------------- memory and calibration


@pytest.mark.parametrize(("gpu", "blocks"), [("H100", 27_229), ("H200", 55_347)])
def test_kv_pool_matches_the_pools_the_engine_reported(gpu, blocks):
    plan = make_plan(PlanRequest(bench_arch("llama-3.1-8b"), GPUS[gpu], 512, 256, max_model_len=4096))
    assert plan["kv_cache"]["num_blocks"] == pytest.approx(blocks, rel=0.02)


def test_fp8_kv_doubles_the_tokens():
    arch = bench_arch("llama-3.1-8b")
    auto = make_plan(PlanRequest(arch, GPUS["H100"], 512, 256, max_model_len=4096))
    fp8 = make_plan(PlanRequest(arch, GPUS["H100"], 512, 256, max_model_len=4096, kv_cache_dtype="fp8"))
    # Recorded: 877,328 / 435,664 tokens = 2.01x (fp8-kv-llama-3.1-8b-h100-engine.json).
    assert fp8["kv_cache"]["capacity_tokens"] / auto["kv_cache"]["capacity_tokens"] == pytest.approx(2.0, rel=0.01)


@pytest.mark.parametrize(
    ("gpu", "latency", "throughput"),
    [
        ("H100", "latency-llama-3.1-8b-h100-dc9b65a-rowgemv1.json", "throughput-llama-3.1-8b-h100-seams-b5c6bbd.json"),
        ("H200", "latency-llama-3.1-8b-h200-dc9b65a-rowgemv1-a.json", "throughput-llama-3.1-8b-h200-dc9b65a-rowgemv1.json"),
    ],
)
def test_the_calibration_table_is_what_its_files_give(gpu, latency, throughput):
    fitted = calibration.fit(GPUS[gpu], bench_arch("llama-3.1-8b"), RESULTS / latency, RESULTS / throughput)
    table = calibration.CALIBRATION[gpu]
    assert latency in table.source and throughput in table.source
    assert fitted.bandwidth == pytest.approx(table.efficiency.bandwidth, rel=1e-3)
    assert fitted.prefill == pytest.approx(table.efficiency.prefill, rel=1e-3)
    assert fitted.first_token_overhead_s == pytest.approx(table.efficiency.first_token_overhead_s, abs=1e-4)
    assert fitted.attention_bandwidth == table.efficiency.attention_bandwidth == calibration.ATTENTION_BANDWIDTH_EFFICIENCY


def test_the_attention_efficiency_is_what_the_decode_profiles_give():
    """Measured, not fitted to a prediction: the paged-attention kernel's time in the engine's own
    decode-step profiles against the KV bytes it reads (batch 64, 512-token context)."""
    fitted = [
        calibration.fit_attention(GPUS[gpu], bench_arch(config), RESULTS / name)
        for config, gpu, name in calibration.ATTENTION_PROFILES
    ]
    assert len({gpu for _, gpu, _ in calibration.ATTENTION_PROFILES}) == 2  # two GPUs agree
    for value in fitted:
        assert value == pytest.approx(calibration.ATTENTION_BANDWIDTH_EFFICIENCY, abs=0.005)
    assert sum(fitted) / len(fitted) == pytest.approx(calibration.ATTENTION_BANDWIDTH_EFFICIENCY, abs=5e-4)
    assert (
        min(c.efficiency.bandwidth for c in calibration.CALIBRATION.values())
        > calibration.ATTENTION_BANDWIDTH_EFFICIENCY
    )


@pytest.mark.parametrize(
    ("key", "config", "quantization"),
    [("fp8", "llama-3.1-8b", "fp8"), ("int4", "llama-3.1-8b", "awq"), ("moe", "qwen3-30b-a3b", None)],
)
def test_the_format_factors_are_what_their_files_give(key, config, quantization):
    table = calibration.FORMAT_FACTORS[key]
    latency, throughput = table.source.split(", ")
    base = calibration.CALIBRATION["H100"].efficiency
    fitted = calibration.fit_format(GPUS["H100"], bench_arch(config), quantization, base, RESULTS / latency, RESULTS / throughput)
    assert fitted.bandwidth == pytest.approx(table.bandwidth, rel=1e-3)
    assert fitted.prefill == pytest.approx(table.prefill, rel=1e-3)


@pytest.mark.parametrize(("method", "quantization"), [("fp8", "fp8"), ("int4", "awq")])
@pytest.mark.parametrize("config", ["qwen3-30b-a3b", "llama-3.1-8b"])
def test_the_same_call_quantized_factors_are_what_their_files_give(method, quantization, config):
    """QUANTIZED_MOE_FACTORS (Qwen3-30B-A3B's routed experts) and QUANTIZED_DENSE_BANDWIDTH (the
    H200's Llama-3.1-8B pair)."""
    if config == "qwen3-30b-a3b":
        table = calibration.QUANTIZED_MOE_FACTORS[method]
    else:
        table = calibration.QUANTIZED_DENSE_BANDWIDTH[(method, "H200")]
    fitted = calibration.fit_same_call_ratio(GPUS[table.gpu], bench_arch(config), quantization, table.files, RESULTS)
    assert fitted == pytest.approx(table.bandwidth, rel=1e-3)


@pytest.mark.parametrize(("method", "quantization"), [("fp8", "fp8"), ("int4", "awq")])
def test_quantized_moe_single_stream_keeps_the_measured_ratio_to_16_bit(method, quantization):
    """The plan of quantized experts against 16-bit ones on the GPU of their runs gives the ratio
    those runs measured in one call (before their factors, the 16-bit MoE's efficiency was applied
    to a quarter of the bytes: 4-bit experts planned faster than 16-bit, measured 0.91x)."""
    quantized_file, base_file = calibration.QUANTIZED_MOE_FACTORS[method].files
    measured = metrics(quantized_file)["decode_tokens_per_s"] / metrics(base_file)["decode_tokens_per_s"]
    plans = [predicted("qwen3-30b-a3b", "H200", 1, q) for q in (quantization, None)]
    assert plans[0]["format_factor"]["format"] == f"moe-{method}"
    ratio = plans[0]["batch1"]["predicted_tokens_per_s"] / plans[1]["batch1"]["predicted_tokens_per_s"]
    assert ratio == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize(("method", "quantization"), [("fp8", "fp8"), ("int4", "awq")])
def test_dense_quantized_single_stream_on_the_h200_keeps_its_measured_ratio(method, quantization):
    """With the H100's format factors the H200 plan gave FP8 1.48x and INT4 1.85x bf16; the H200's
    own same-call pair measured 1.36x / 1.54x, and the plan now gives those (within 1 %), while the
    H100 plans still come from the H100 factors."""
    quantized_file, base_file = calibration.QUANTIZED_DENSE_BANDWIDTH[(method, "H200")].files
    measured = metrics(quantized_file)["decode_tokens_per_s"] / metrics(base_file)["decode_tokens_per_s"]
    plans = [predicted("llama-3.1-8b", "H200", 1, q) for q in (quantization, None)]
    assert "(H200)" in plans[0]["format_factor"]["source"]
    ratio = plans[0]["batch1"]["predicted_tokens_per_s"] / plans[1]["batch1"]["predicted_tokens_per_s"]
    assert ratio == pytest.approx(measured, rel=0.01)
    h100 = predicted("llama-3.1-8b", "H100", 1, quantization)["format_factor"]["source"]
    assert h100 == calibration.FORMAT_FACTORS[method].source


# ----------------------------------------------------------------------------- predictions vs recorded runs


def predicted(config: str, gpu: str, concurrency: int, quantization: str | None = None, tp: int = 1) -> dict:
    return make_plan(
        PlanRequest(
            bench_arch(config), GPUS[gpu], 512, 256, tensor_parallel=tp, quantization=quantization,
            concurrency=concurrency, max_model_len=4096,
        )
    )  # fmt: skip


def within(got: float, recorded: float) -> bool:
    return abs(got / recorded - 1) <= PREDICTION_TOLERANCE


@pytest.mark.parametrize(
    ("config", "gpu", "quantization", "latency", "throughput"),
    [
        # Calibration points (the table's own files):
        ("llama-3.1-8b", "H200", None, "latency-llama-3.1-8b-h200-dc9b65a-rowgemv1-a.json", "throughput-llama-3.1-8b-h200-dc9b65a-rowgemv1.json"),
        ("llama-3.1-8b", "H100", None, "latency-llama-3.1-8b-h100-dc9b65a-rowgemv1.json", "throughput-llama-3.1-8b-h100-seams-b5c6bbd.json"),
        ("llama-3.1-8b", "H100", "fp8", "latency-llama-3.1-8b-fp8-h100.json", "throughput-llama-3.1-8b-fp8-h100.json"),
        ("qwen3-30b-a3b", "H100", None, "latency-qwen3-30b-a3b-h100-827f681.json", "throughput-qwen3-30b-a3b-h100-827f681.json"),
        # Held out: other runs of other commits.
        ("llama-3.1-8b", "H200", None, "latency-llama-3.1-8b-h200-e72e1d5-a.json", "throughput-llama-3.1-8b-h200.json"),
        ("llama-3.1-8b", "H100", None, "latency-llama-3.1-8b-h100-seams-8a66eea-a.json", "throughput-llama-3.1-8b-h100-seams-8a66eea.json"),
    ],
)
def test_single_stream_and_offline_predictions_hold(config, gpu, quantization, latency, throughput):
    single = predicted(config, gpu, 1, quantization)["batch1"]["predicted_tokens_per_s"]
    offline = predicted(config, gpu, 256, quantization)["at_concurrency"]["output_tokens_per_s"]
    assert within(single, metrics(latency)["decode_tokens_per_s"]), (single, metrics(latency)["decode_tokens_per_s"])
    assert within(offline, metrics(throughput)["output_tokens_per_s"]), (offline, metrics(throughput)["output_tokens_per_s"])


def test_the_all_reduce_latency_is_what_its_file_gives():
    fitted = calibration.fit_all_reduce(
        GPUS["H200"], bench_arch("llama-3.1-8b"), RESULTS / "multi-gpu-single-llama-3.1-8b-tp2-h200-b614d33.json", 2
    )
    table = calibration.ALL_REDUCE["H200"].cost
    assert fitted.latency_s == pytest.approx(table.latency_s, rel=1e-3)
    assert fitted.bus_bytes_per_s == table.bus_bytes_per_s
    assert 1e-6 < table.latency_s < 1e-4, "an NCCL all-reduce in a CUDA graph takes microseconds"


@pytest.mark.parametrize(
    ("config", "concurrency", "tp", "result"),
    [
        ("llama-3.1-8b", 256, 2, "multi-gpu-offline-llama-3.1-8b-tp2-h200-b614d33.json"),
        ("llama-3.1-70b", 1, 2, "multi-gpu-single-llama-3.1-70b-tp2-h200-b614d33.json"),
        ("llama-3.1-70b", 256, 2, "multi-gpu-offline-llama-3.1-70b-tp2-h200-b614d33.json"),
        # 4 x H200, measured after the fit (+11.6 %, +0.1 %, +1.9 % when added)
        ("llama-3.1-8b", 1, 4, "multi-gpu-single-llama-3.1-8b-tp4-h200-ac1fbba.json"),
        ("llama-3.1-70b", 1, 4, "multi-gpu-single-llama-3.1-70b-tp4-h200-ac1fbba.json"),
        ("llama-3.1-70b", 256, 4, "multi-gpu-offline-llama-3.1-70b-tp4-h200-ac1fbba.json"),
    ],
)
def test_tensor_parallel_predictions_hold(config, concurrency, tp, result):
    """Held out: the 2 x and 4 x H200 runs the all-reduce latency was not fitted on. Without the
    all-reduce term the 8B TP=2 predictions were 77 % (single) and 42 % (offline) too high."""
    plan = predicted(config, "H200", concurrency, tp=tp)
    run = metrics(result)
    if concurrency == 1:
        got, recorded = plan["batch1"]["predicted_tokens_per_s"], run["decode_tokens_per_s"]
    else:
        got, recorded = plan["at_concurrency"]["output_tokens_per_s"], run["output_tokens_per_s"]
    assert within(got, recorded), (got, recorded)
    assert plan["all_reduce"]["source"].startswith("multi-gpu-single-llama-3.1-8b-tp2-h200")


def test_one_gpu_plans_pay_no_all_reduce():
    assert "all_reduce" not in predicted("llama-3.1-8b", "H200", 1)
    assert predicted("llama-3.1-8b", "H100", 1, tp=2)["all_reduce"]["source"].startswith("no H100 tensor-parallel")


def test_a_model_never_calibrated_gemma_single_stream_and_offline_hold():
    """Held out: Gemma-2-9B shapes on an H100. Offline it was +25.2 % while the model charged KV
    reads at the linear layers' bandwidth efficiency and took the longer of bytes and FLOPs for the
    whole step; its decode step is mostly KV (344 KiB a token), which the attention kernel reads at
    0.57 of the peak, not 0.84 (test_the_attention_efficiency_is_what_the_decode_profiles_give)."""
    single = predicted("gemma-2-9b", "H100", 1)["batch1"]["predicted_tokens_per_s"]
    assert within(single, metrics("latency-gemma-2-9b-h100-47868d2.json")["decode_tokens_per_s"])
    offline = predicted("gemma-2-9b", "H100", 256)["at_concurrency"]["output_tokens_per_s"]
    recorded = metrics("throughput-gemma-2-9b-h100-47868d2.json")["output_tokens_per_s"]
    assert within(offline, recorded), (offline, recorded)


def test_gemma_pays_for_its_soft_capped_logits_and_wide_heads():
    """The step's terms by kernel: Gemma 2's final soft cap adds three read + write passes over the
    [B, 256,000] float32 logits, and its KV is most of a batch-256 step."""
    from tokenmill.plan.roofline import Machine, model_shape, step_cost

    gemma, llama = bench_arch("gemma-2-9b"), bench_arch("llama-3.1-8b")
    assert model_shape(gemma).final_logit_softcap and not model_shape(llama).final_logit_softcap
    assert model_shape(gemma).logits_bytes(256) == 8 * 256 * 256_000 * 4
    assert model_shape(llama).logits_bytes(256) == 2 * 256 * 128_256 * 4
    eff = calibration.CALIBRATION["H100"].efficiency
    machine = Machine(GPUS["H100"], 1, fp8_compute=False)
    cost = step_cost(machine, model_bytes(gemma), kv_layout(gemma, 4096), model_shape(gemma), eff, 256, 640)
    assert cost.attention_s > 2 * cost.linear_s
    assert cost.total_s == pytest.approx(cost.linear_s + cost.attention_s + cost.logits_s)


def test_h200_from_the_h100_factors_holds(monkeypatch):
    """Across GPUs: the H200 predicted with the H100's efficiencies (only the datasheet differs)."""
    h100 = calibration.CALIBRATION["H100"]
    monkeypatch.setitem(calibration.CALIBRATION, "H200", dataclasses.replace(calibration.CALIBRATION["H200"], efficiency=h100.efficiency))
    single = predicted("llama-3.1-8b", "H200", 1)["batch1"]["predicted_tokens_per_s"]
    offline = predicted("llama-3.1-8b", "H200", 256)["at_concurrency"]["output_tokens_per_s"]
    assert within(single, metrics("latency-llama-3.1-8b-h200-dc9b65a-rowgemv1-a.json")["decode_tokens_per_s"])
    assert within(offline, metrics("throughput-llama-3.1-8b-h200-dc9b65a-rowgemv1.json")["output_tokens_per_s"])


@pytest.mark.parametrize(
    ("gpu", "result"),
    [
        ("H100", "serve-llama-3.1-8b-h100-seams-b5c6bbd-rate-8-1.json"),
        ("H100", "serve-tail-llama-3.1-8b-h100-rate-16-0c78bdb.json"),
        ("H100", "serve-tail-llama-3.1-8b-h100-rate-24-0c78bdb.json"),
        ("H100", "serve-tail-llama-3.1-8b-h100-rate-32-0c78bdb.json"),
        ("H200", "serve-llama-3.1-8b-h200-rate-4.json"),
        ("H200", "serve-llama-3.1-8b-h200-rate-8.json"),
        ("H200", "serve-llama-3.1-8b-h200-rate-16.json"),
    ],
)
def test_serving_tpot_at_the_measured_concurrency_holds(gpu, result):
    """Held out: `bench serve` runs (512 in / 256 out) at a request rate; their mean concurrency
    (Little's law: completed req/s x mean e2e) is what the planner is asked about."""
    run = metrics(result)
    concurrency = round(run["request_throughput"] * run["mean_e2el_ms"] / 1000)
    tpot = predicted("llama-3.1-8b", gpu, concurrency)["at_concurrency"]["tpot_ms"]
    assert within(tpot, run["mean_tpot_ms"]), (concurrency, tpot, run["mean_tpot_ms"])


def _serve_ttft(gpu: str, result: str) -> tuple[float, float]:
    run = metrics(result)
    concurrency = littles_law_concurrency(run)
    return predicted("llama-3.1-8b", gpu, concurrency)["at_concurrency"]["served_ttft_ms"], run["median_ttft_ms"]


def test_host_cost_matches_its_calibration_file():
    """The API server's cost per stream in flight (host_cost.py) is what fit_host_cost gives from
    its one calibration run, the traced H100 run at 16 req/s."""
    assert HOST_COST.per_stream_s == pytest.approx(fit_host_cost(RESULTS / SERVE_HOST_CALIBRATION[1]), rel=1e-3)
    assert SERVE_HOST_CALIBRATION[1] in HOST_COST.source


# The served TTFT (`bench serve`'s client, Poisson arrivals, streaming) = the engine's TTFT (the
# roofline model) + the host's share (host_cost.py: per stream in flight, fitted on this run's API
# stages). Calibration point of the host cost; its engine share is a prediction.
SERVE_HOST_CALIBRATION = ("H100", "serve-tail-llama-3.1-8b-h100-rate-16-0c78bdb.json")
# Held out (none of them fitted anything): the H100 at 24 and 32 req/s (same tree and host as the
# calibration run), the H200 at 4 / 8 / 16 req/s (`6a0e8f3`) and at 24 / 32 req/s (`57007fe`,
# traced), whose host borrows the H100 host's cost.
SERVE_TTFT_HELD_OUT = [
    ("H100", "serve-tail-llama-3.1-8b-h100-rate-24-0c78bdb.json"),
    ("H100", "serve-tail-llama-3.1-8b-h100-rate-32-0c78bdb.json"),
    ("H200", "serve-llama-3.1-8b-h200-rate-4.json"),
    ("H200", "serve-llama-3.1-8b-h200-rate-8.json"),
    ("H200", "serve-llama-3.1-8b-h200-rate-16.json"),
    ("H200", "serve-tail-llama-3.1-8b-h200-rate-24-57007fe.json"),
    ("H200", "serve-tail-llama-3.1-8b-h200-rate-32-57007fe.json"),
]


@pytest.mark.parametrize(("gpu", "result"), [SERVE_HOST_CALIBRATION, *SERVE_TTFT_HELD_OUT])
def test_served_ttft_at_the_measured_concurrency_holds(gpu, result):
    """The median TTFT of `bench serve`. The engine's share charges the residual of the step a
    random arrival lands in, the step async scheduling has already launched and its own prefill
    step; the host's share the API server's and the client's time per stream in flight. Before
    (the engine's share alone, its own step a decode step plus a prompt) the H100 at 24 / 32 req/s
    was -32 % / -49 % and the H200 at 24 / 32 req/s -40 % / -51 %."""
    got, recorded = _serve_ttft(gpu, result)
    assert within(got, recorded), (got, recorded)


# Not held: the H100 at 8 req/s of `b5c6bbd`, a tree before the serving-tail fixes (median 72 ms
# with in-request stalls; 44 ms at 8 req/s on `0c78bdb`).
@pytest.mark.xfail(strict=True, reason="in-request stalls (JIT compiles, GC) before 0c78bdb, not modelled")
def test_served_ttft_before_the_serving_tail_fixes_is_a_known_miss():
    got, recorded = _serve_ttft("H100", "serve-llama-3.1-8b-h100-seams-b5c6bbd-rate-8-1.json")
    assert within(got, recorded), (got, recorded)


TRACED_HELD_OUT = [r for r in SERVE_TTFT_HELD_OUT if r[1].startswith("serve-tail-")]


@pytest.mark.parametrize(("gpu", "result"), [SERVE_HOST_CALIBRATION, *TRACED_HELD_OUT])
def test_decode_and_prefill_steps_hold_against_the_step_trace(gpu, result):
    """Held out: the steps the serving TTFT is made of, against the engine's step trace of the same
    run (metrics.tail.steps: each step's gap, decode-only steps in a CUDA graph and steps with a
    prefill chunk, medians). A step that prefills a prompt among C - 1 decodes costs the longer of
    the weights' bytes and all its rows' FLOPs: charged as a decode step plus a prompt, as the TTFT
    did before, it was 17.9 vs 11.8 ms on the H100 at 16 req/s (+52 %)."""
    run = metrics(result)
    plan = predicted("llama-3.1-8b", gpu, littles_law_concurrency(run))["at_concurrency"]
    gaps = run["tail"]["steps"]["gap_ms"]
    assert within(plan["decode_step_ms"], gaps["graph_decode"]["p50"]), (plan["decode_step_ms"], gaps)
    assert within(plan["prefill_step_ms"], gaps["with_prefill"]["p50"]), (plan["prefill_step_ms"], gaps)


def _shares(gpu: str, result: str) -> tuple[dict, dict]:
    """(predicted, traced) engine and host shares of the TTFT, ms; traced = sums of stage medians."""
    run = metrics(result)
    plan = predicted("llama-3.1-8b", gpu, littles_law_concurrency(run))["at_concurrency"]
    got = {"engine": plan["ttft_ms"], "host": plan["api_server_ttft_ms"]}
    return got, {"engine": stage_sum_ms(run, ENGINE_STAGES), "host": stage_sum_ms(run, HOST_STAGES)}


@pytest.mark.parametrize(
    ("gpu", "result"),
    [
        *TRACED_HELD_OUT,
        pytest.param(
            *SERVE_HOST_CALIBRATION,
            marks=pytest.mark.xfail(
                strict=True, reason="+55 %: the H100's 19.9 ms first-token overhead, fitted on dc9b65a's single stream"
            ),
        ),
    ],
)
def test_engine_share_of_the_ttft_holds_against_the_trace(gpu, result):
    """Held out, stage by stage: the roofline model's TTFT against the traced engine stages
    (to_engine + queued + prefill medians). At 16 req/s on the H100 the engine's share is
    over-predicted (45.5 vs 29.4 ms): the H100's first-token overhead comes from a single stream at
    `dc9b65a` (TTFT 29-31 ms in its three runs; 17-21 ms in the second call of later trees), which
    the 0c78bdb serving tree does not pay; at 24 / 32 req/s the waits the model lacks make up for it."""
    got, traced = _shares(gpu, result)
    assert within(got["engine"], traced["engine"]), (got, traced)


@pytest.mark.parametrize(
    ("gpu", "result"),
    [
        TRACED_HELD_OUT[0],
        pytest.param(*TRACED_HELD_OUT[1], marks=pytest.mark.xfail(strict=True, reason="+27 %: the host stages grow slower than C (0.41, 0.38, 0.32 ms a stream at 16, 24, 32 req/s)")),
        pytest.param(*TRACED_HELD_OUT[2], marks=pytest.mark.xfail(strict=True, reason="+54 %: the H200 machine's host stages, 0.27 ms a stream, against the borrowed 0.41")),
        pytest.param(*TRACED_HELD_OUT[3], marks=pytest.mark.xfail(strict=True, reason="+68 %: the H200 machine's host stages, 0.25 ms a stream, against the borrowed 0.41")),
    ],
)
def test_host_share_of_the_ttft_against_the_trace(gpu, result):
    """Held out, stage by stage: the host's share (per stream in flight x concurrency) against the
    traced host stages (api_in + engine_to_api + api_to_client medians)."""
    got, traced = _shares(gpu, result)
    assert within(got["host"], traced["host"]), (got, traced)


# ----------------------------------------------------------------------------- the command


def test_plan_command_json_and_text(capsys):
    config = str(CONFIGS / "llama-3.1-8b" / "config.json")
    from tokenmill.cli import main

    assert main(["plan", config, "--gpu", "h100", "--input-len", "512", "--output-len", "256", "--price-per-hour", "3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["cost"]["usd_per_million_output_tokens"] > 0
    at = plan["at_concurrency"]
    assert at["served_ttft_ms"] == pytest.approx(at["ttft_ms"] + at["api_server_ttft_ms"])
    assert at["api_server_ttft_ms"] == pytest.approx(at["concurrency"] * plan["host_cost"]["per_stream_ms"])
    assert plan["host_cost"]["source"] == HOST_COST.source  # the H100's host is the calibrated one
    assert plan["max_concurrency"]["at_max_model_len"] == pytest.approx(plan["kv_cache"]["capacity_tokens"] / 131072)
    assert main(["plan", str(CONFIGS / "gemma-2-9b"), "--gpu", "L40S", "--tp", "2", "--input-len", "100", "--output-len", "10"]) == 0
    text = capsys.readouterr().out
    assert "UNCALIBRATED" in text and "2 x L40S" in text and "TPOT" in text
    assert "streamed through the API server" in text and "no traced serving run on a L40S machine" in text
    # 61 GB of Qwen3-30B-A3B weights do not leave room on an L40S.
    assert main(["plan", str(CONFIGS / "qwen3-30b-a3b"), "--gpu", "L40S", "--input-len", "8", "--output-len", "8"]) == 1
    assert "does not fit" in capsys.readouterr().out
    assert main(["plan", config, "--gpu", "B200", "--input-len", "8", "--output-len", "8"]) == 2
    assert "unknown --gpu 'B200'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--tp 3 must divide"):
        make_plan(PlanRequest(bench_arch("llama-3.1-8b"), gpu_spec("H100"), 8, 8, tensor_parallel=3))


def test_plan_imports_no_torch():
    code = (
        "import sys; from tokenmill.cli import main;"
        f"main(['plan', {str(CONFIGS / 'llama-3.1-8b')!r}, '--gpu', 'H200', '--input-len', '8', '--output-len', '8']);"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_plan_main_returns_nonzero_when_it_does_not_fit(capsys):
    import argparse

    args = argparse.Namespace(
        model=str(CONFIGS / "qwen3-30b-a3b" / "config.json"), gpu="L40S", tp=1, quantization=None, kv_cache_dtype="auto",
        input_len=8, output_len=8, concurrency=None, max_model_len=None, price_per_hour=None, json=True,
    )  # fmt: skip
    assert plan_main(args) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False


def test_plan_help_names_its_outputs_and_docs(capsys):
    from tokenmill.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "streamed through the API server" in text and "docs/PLANNER.md" in text and "--concurrency" in text
