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
  TTFT = prefill(I) + first_token_overhead at C = 1. When C > 1 a request arrives at a random time
         (Poisson) into a stream of decode-only steps, step(C), and steps that also prefill a
         prompt, mixed(C): C - 1 decodes and I prompt tokens through the linear layers in one
         read of the weights (the longer of bytes and all the rows' FLOPs), plus the decodes'
         attention. The fraction f of mixed steps makes the mean step the TPOT above. It waits
         the residual of the step in flight, E[S^2] / 2E[S], then one mean step (with async
         scheduling the engine has launched the next step when it admits it), then its own mixed
         step, + first_token_overhead (serving_ttft_seconds)
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
    mixed_step_s: float  # one step of concurrency - 1 decodes and one prompt
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


def mixed_step_seconds(
    machine: Machine,
    weights: ModelBytes,
    kv: KVLayout,
    shape: ModelShape,
    eff: Efficiency,
    decodes: int,
    context: float,
    prompt_tokens: int,
) -> float:
    """One step that decodes `decodes` sequences and prefills one prompt: its linear layers read the
    weights once for all its rows, so they cost the longer of those bytes and all the rows' FLOPs
    (not a decode step plus a prompt); the decodes' attention and the logits come on top."""
    bandwidth = machine.bandwidth * eff.bandwidth
    body = weights.params_per_token - shape.lm_head_params
    rows = decodes + prompt_tokens
    flops = (
        2 * body * rows
        + 2 * shape.lm_head_params * (decodes + 1)
        + 2 * prompt_tokens * prompt_tokens * shape.q_size * shape.num_layers
    )
    linear = max(weights.decode_read_bytes(rows) / bandwidth, flops / (machine.flops * eff.prefill))
    decode = step_cost(machine, weights, kv, shape, eff, decodes, context)
    return linear + decode.attention_s + shape.logits_bytes(decodes + 1) / bandwidth


def serving_ttft_seconds(step: float, mean_step: float, mixed: float, overhead: float) -> float:
    """Engine TTFT of a request arriving at a random time (Poisson) among C - 1 running ones.

    Steps are decode-only (`step`) or carry a prompt (`mixed`); the fraction f that carry one is
    what makes their mean the model's mean step (its TPOT). The request waits for the step in
    flight when it arrives, its residual E[S^2] / 2E[S] (a random arrival lands in long steps more
    often), then one mean step more (async scheduling has launched the next step before the
    engine admits it), then its own mixed step."""
    f = min(1.0, max(0.0, (mean_step - step) / (mixed - step))) if mixed > step else 1.0
    mean = (1 - f) * step + f * mixed
    residual = ((1 - f) * step**2 + f * mixed**2) / (2 * mean)
    return residual + mean + mixed + overhead


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
    decodes = work.concurrency - 1
    mixed = mixed_step_seconds(machine, weights, kv, shape, eff, decodes, context, work.input_len)
    mixed += comm(decodes + work.input_len)
    if work.concurrency > 1:
        ttft = serving_ttft_seconds(step, tpot, mixed, eff.first_token_overhead_s)
    else:  # alone: the engine is idle when it arrives, its prompt is the whole step
        ttft = prefill + eff.first_token_overhead_s
    lifetime = ttft + (out - 1) * tpot
    one = step_cost(machine, weights, kv, shape, eff, 1, context).total_s + comm(1)
    kv_one = context * kv.mean_bytes_per_token(int(context)) * machine.tensor_parallel
    roofline = machine.bandwidth / (weights.decode_read_bytes(1) + kv_one)
    return Prediction(
        step_s=step,
        mixed_step_s=mixed,
        prefill_s=prefill,
        ttft_s=ttft,
        tpot_s=tpot,
        output_tokens_per_s=work.concurrency * out / lifetime,
        batch1_roofline_tokens_per_s=roofline,
        batch1_tokens_per_s=1 / one,
    )
