"""The roofline model `tokenmill plan` predicts with, and the efficiency factors it takes.

A decode step of B sequences at mean context L reads the weights it needs (model_bytes.py: all
dense weights, the routed experts its tokens pick) and B x L tokens of KV, and multiplies
2 x active params x B; it takes the longer of bytes / (peak bandwidth x bandwidth_efficiency) and
FLOPs / (peak FLOP/s x prefill_efficiency). A prompt of I tokens costs 2 x active params x I plus
its attention (2 x I^2 x q_size x layers) FLOPs at peak x prefill_efficiency.

Serving C requests at once, each I in / O out, in steady state:
  TPOT = step(C) + (C - 1) x prefill(I) / O    (the other requests' prefills share the steps)
  TTFT = prefill(I) + first_token_overhead (+ one step(C) in flight when C > 1)
  output tok/s = C x O / (TTFT + (O - 1) x TPOT)
The factors are fitted per GPU from our own benchmark results (calibration.py).

Tensor parallelism over N GPUs adds up the GPUs' bandwidth and FLOP/s, and charges each forward
two all-reduces per layer (after attention, after the MLP) of tokens x hidden 16-bit values:
latency + bytes x 2(N-1)/N / bus bandwidth each (AllReduceCost). At batch 1 the latency is all of
it, and at 8B shapes it is most of what TP=2 loses.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.plan.gpu_specs import GpuSpec
from tokenmill.plan.model_bytes import KVLayout, ModelBytes


@dataclass(frozen=True, slots=True)
class Efficiency:
    bandwidth: float  # achieved / peak memory bandwidth in decode
    prefill: float  # achieved / peak dense FLOP/s
    first_token_overhead_s: float  # TTFT beyond the prompt's compute at batch 1


@dataclass(frozen=True, slots=True)
class Workload:
    input_len: int
    output_len: int
    concurrency: int


@dataclass(frozen=True, slots=True)
class Prediction:
    step_s: float  # one decode step at the concurrency
    prefill_s: float  # one prompt's compute
    ttft_s: float
    tpot_s: float
    output_tokens_per_s: float
    batch1_roofline_tokens_per_s: float  # peak bandwidth, no efficiency factor
    batch1_tokens_per_s: float  # the calibrated single stream


@dataclass(frozen=True, slots=True)
class AllReduceCost:
    latency_s: float  # one small all-reduce as a decode step pays it (launch, sync, the link's latency)
    bus_bytes_per_s: float  # a large all-reduce's bus bandwidth (NCCL's busbw)


@dataclass(frozen=True, slots=True)
class Machine:
    """What the model runs on: one GPU's spec times the tensor-parallel ranks."""

    gpu: GpuSpec
    tensor_parallel: int
    fp8_compute: bool  # FP8 W8A8 runs its matmuls on FP8 tensor cores
    all_reduce: AllReduceCost | None = None  # None: collectives cost nothing (one GPU)

    @property
    def bandwidth(self) -> float:
        return self.gpu.bandwidth_bytes_per_s * self.tensor_parallel

    @property
    def flops(self) -> float:
        return self.gpu.flops(self.fp8_compute) * self.tensor_parallel


def all_reduce_seconds(machine: Machine, num_layers: int, hidden_size: int, tokens: int) -> float:
    """The all-reduces of one forward over `tokens` tokens: two per layer of tokens x hidden bf16."""
    n, cost = machine.tensor_parallel, machine.all_reduce
    if n == 1 or cost is None:
        return 0.0
    moved = tokens * hidden_size * 2 * 2 * (n - 1) / n  # a ring's bytes per rank
    return 2 * num_layers * (cost.latency_s + moved / cost.bus_bytes_per_s)


def step_seconds(
    machine: Machine, weights: ModelBytes, kv: KVLayout, eff: Efficiency, batch: int, context: float
) -> float:
    kv_bytes = batch * context * kv.mean_bytes_per_token(int(context)) * machine.tensor_parallel
    read = weights.decode_read_bytes(batch) + kv_bytes
    flops = 2 * weights.params_per_token * batch
    return max(read / (machine.bandwidth * eff.bandwidth), flops / (machine.flops * eff.prefill))


def prefill_seconds(
    machine: Machine, weights: ModelBytes, q_size: int, num_layers: int, eff: Efficiency, tokens: int
) -> float:
    flops = 2 * weights.params_per_token * tokens + 2 * tokens * tokens * q_size * num_layers
    return flops / (machine.flops * eff.prefill)


def predict(
    machine: Machine,
    weights: ModelBytes,
    kv: KVLayout,
    eff: Efficiency,
    work: Workload,
    q_size: int,
    num_layers: int,
    hidden_size: int,
) -> Prediction:
    context = work.input_len + work.output_len / 2

    def comm(tokens: int) -> float:
        return all_reduce_seconds(machine, num_layers, hidden_size, tokens)

    step = step_seconds(machine, weights, kv, eff, work.concurrency, context) + comm(work.concurrency)
    prefill = prefill_seconds(machine, weights, q_size, num_layers, eff, work.input_len) + comm(
        work.input_len
    )
    out = max(work.output_len, 1)
    tpot = step + (work.concurrency - 1) * prefill / out
    ttft = prefill + eff.first_token_overhead_s + (step if work.concurrency > 1 else 0.0)
    lifetime = ttft + (out - 1) * tpot
    one = step_seconds(machine, weights, kv, eff, 1, context) + comm(1)
    kv_one = context * kv.mean_bytes_per_token(int(context)) * machine.tensor_parallel
    roofline = machine.bandwidth / (weights.decode_read_bytes(1) + kv_one)
    return Prediction(
        step_s=step,
        prefill_s=prefill,
        ttft_s=ttft,
        tpot_s=tpot,
        output_tokens_per_s=work.concurrency * out / lifetime,
        batch1_roofline_tokens_per_s=roofline,
        batch1_tokens_per_s=1 / one,
    )
