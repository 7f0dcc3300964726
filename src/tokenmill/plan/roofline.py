"""The roofline model `tokenmill plan` predicts with, and the efficiency factors it takes.

A decode step of B sequences at mean context L is the kernels it launches, one after another on
the GPU, so their times add (they do not overlap):
  linear layers: the longer of (the weights it reads, model_bytes.py: all dense weights, the routed
    experts its tokens pick) / (peak bandwidth x bandwidth_efficiency) and 2 x active params x B
    FLOPs / (peak FLOP/s x prefill_efficiency);
  attention: the longer of B x L tokens of KV read at the paged-attention kernel's own bandwidth
    efficiency (measured in the engine's decode profiles, calibration.py) and its 4 x B x L x
    q_size x layers FLOPs (q.k and p.v);
  logits: B x vocab fp32 logits written by the lm_head and read back by the sampler, plus, where
    the model soft-caps its final logits (Gemma 2), the three in-place passes (divide, tanh,
    multiply) over them.
A prompt of I tokens costs 2 x (active params - lm_head) x I (only its last position reaches the
lm_head) + 2 x lm_head params, plus its attention (2 x I^2 x q_size x layers, causal) FLOPs at peak
x prefill_efficiency.

Serving C requests at once, each I in / O out, in steady state:
  TPOT = step(C) + (C - 1) x prefill(I) / O    (the other requests' prefills share the steps)
  TTFT = prefill(I) + first_token_overhead, and when C > 1 also ARRIVAL_WAIT_STEPS x step(C): a
         request arriving at a random time waits half a step for the one running to end, then one
         more (with async scheduling the engine has already launched the next step when it admits
         it), then its own prefill step carries the C - 1 decodes as well (one more step(C))
  output tok/s = C x O / (TTFT + (O - 1) x TPOT)
The factors are fitted per GPU from our own benchmark results (calibration.py).

Tensor parallelism over N GPUs adds up the GPUs' bandwidth and FLOP/s, and charges each forward
two all-reduces per layer (after attention, after the MLP) of tokens x hidden 16-bit values:
latency + bytes x 2(N-1)/N / bus bandwidth each (AllReduceCost). At batch 1 the latency is all of
it, and at 8B shapes it is most of what TP=2 loses.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.model.arch import ArchConfig
from tokenmill.plan.gpu_specs import GpuSpec
from tokenmill.plan.model_bytes import KVLayout, ModelBytes


@dataclass(frozen=True, slots=True)
class Efficiency:
    bandwidth: float  # achieved / peak memory bandwidth of the linear layers in decode
    prefill: float  # achieved / peak dense FLOP/s
    first_token_overhead_s: float  # TTFT beyond the prompt's compute at batch 1
    attention_bandwidth: float  # achieved / peak memory bandwidth of the paged-attention kernel's KV reads


# A request arriving at a random time (open loop) waits on average half of the step then running,
# and with async scheduling one more: the engine schedules step N + 2 while step N + 1 runs, so a
# request it admits after step N joins step N + 2. (Its own step, which also carries the other
# requests' decodes, is charged on top as one step(C).)
ARRIVAL_WAIT_STEPS = 1.5
LOGITS_BYTES = 4  # the lm_head writes float32 logits
SOFTCAP_PASSES = 3  # logits.div_(cap).tanh_().mul_(cap): three in-place read + write passes


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the step and prompt costs need beyond the weight bytes."""

    q_size: int  # num_heads x head_dim
    num_layers: int
    hidden_size: int
    vocab_size: int
    final_logit_softcap: bool  # Gemma 2: cap x tanh(logits / cap) over the whole [B, vocab]

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def logits_bytes(self, tokens: int) -> float:
        """Memory traffic of one step's logits beyond the lm_head's weights: written once, read
        once by the sampler, and each soft-cap pass reads and writes them again."""
        passes = 2 + (2 * SOFTCAP_PASSES if self.final_logit_softcap else 0)
        return passes * tokens * self.vocab_size * LOGITS_BYTES


def model_shape(arch: ArchConfig) -> ModelShape:
    return ModelShape(
        arch.q_size, arch.num_layers, arch.hidden_size, arch.vocab_size, arch.final_logit_softcap is not None
    )


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


@dataclass(frozen=True, slots=True)
class StepCost:
    """One decode step's time, by the kernels that spend it (they run one after another)."""

    linear_s: float
    attention_s: float
    logits_s: float

    @property
    def total_s(self) -> float:
        return self.linear_s + self.attention_s + self.logits_s


def step_cost(
    machine: Machine,
    weights: ModelBytes,
    kv: KVLayout,
    shape: ModelShape,
    eff: Efficiency,
    batch: int,
    context: float,
) -> StepCost:
    bandwidth = machine.bandwidth * eff.bandwidth
    flop_rate = machine.flops * eff.prefill
    linear = max(
        weights.decode_read_bytes(batch) / bandwidth, 2 * weights.params_per_token * batch / flop_rate
    )
    kv_bytes = batch * context * kv.mean_bytes_per_token(int(context)) * machine.tensor_parallel
    attention_flops = 4 * batch * context * shape.q_size * shape.num_layers
    attention = max(kv_bytes / (machine.bandwidth * eff.attention_bandwidth), attention_flops / flop_rate)
    return StepCost(linear, attention, shape.logits_bytes(batch) / bandwidth)


def prefill_seconds(
    machine: Machine, weights: ModelBytes, shape: ModelShape, eff: Efficiency, tokens: int
) -> float:
    """One prompt's forward: every position through the layers, only the last through the lm_head."""
    body = weights.params_per_token - shape.lm_head_params
    flops = (
        2 * body * tokens + 2 * shape.lm_head_params + 2 * tokens * tokens * shape.q_size * shape.num_layers
    )
    return flops / (machine.flops * eff.prefill)


def predict(
    machine: Machine,
    weights: ModelBytes,
    kv: KVLayout,
    eff: Efficiency,
    work: Workload,
    shape: ModelShape,
) -> Prediction:
    context = work.input_len + work.output_len / 2

    def comm(tokens: int) -> float:
        return all_reduce_seconds(machine, shape.num_layers, shape.hidden_size, tokens)

    step = step_cost(machine, weights, kv, shape, eff, work.concurrency, context).total_s + comm(work.concurrency)
    prefill = prefill_seconds(machine, weights, shape, eff, work.input_len) + comm(work.input_len)
    out = max(work.output_len, 1)
    tpot = step + (work.concurrency - 1) * prefill / out
    waited = (ARRIVAL_WAIT_STEPS + 1) * step if work.concurrency > 1 else 0.0
    ttft = prefill + eff.first_token_overhead_s + waited
    lifetime = ttft + (out - 1) * tpot
    one = step_cost(machine, weights, kv, shape, eff, 1, context).total_s + comm(1)
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
