"""Start-up warm-up of the kernel variants that the profiling run and the CUDA graphs miss.

Triton compiles a kernel variant the first time a process launches it (0.5-1.2 s each for the
paged attention kernel with an empty cache, tens to hundreds of milliseconds to load one from the
on-disk cache), and the engine would otherwise pay that inside a user's request: every request of
that step stalls. The memory profile runs one large prefill and the graphs cover decode-only
batches at their captured sizes; serving also runs eager steps:

- with 1-8 rows (a short prefill chunk, e.g. after a prefix-cache hit: the row GEMV without a
  residual, the skinny GEMM with the non-deferred layer path): `WARMUP_STEPS`;
- mixed prefill + decode batches, whose attention launches a prefill flavour with tiles sized by
  the longest chunk and a decode flavour whose tiles depend on the batch size and whose split-KV
  count on the number of decodes and the longest context; decode-only steps that take no graph
  (a request whose prompt ends with a one-token chunk, a batch past the largest graph, or every
  decode-only step with --enforce-eager): the attention backend lists the variants a step
  launches (`kernel_variants`), and `plan_warmup_steps` picks a few steps that launch every
  variant some serving step could, less those the fixed steps and the graph capture compiled;
- after each, the greedy sampler's kernels (kernels/triton/greedy.py), as `_sample` runs them.

Each step runs once the way ModelRunner.launch would run it: through the piecewise CUDA graphs
when they take its token count (attention eager between the pieces, reading the engine's KV pool;
inside them no decode step fuses RoPE into attention), else eagerly against a scratch KV cache of
one block per layer. Every block-table entry names block 0 (worker/scratch_step.py), so a long
context costs no memory; slot -1 writes nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Every block-table entry of a warm-up step names one of this many scratch blocks (per layer).
SCRATCH_BLOCKS = 1


@dataclass(frozen=True, slots=True)
class WarmupStep:
    """A batch the warm-up runs: the prefill chunks (query_len, seq_len) first, then `num_decodes`
    one-token decodes of sequences `decode_seq_len` long. `decode_only` is what the model runner
    sets when every query_len is 1 (the one-token prefill of WARMUP_STEPS runs as a mixed batch)."""

    prefills: tuple[tuple[int, int], ...] = ()
    num_decodes: int = 0
    decode_seq_len: int = 1
    decode_only: bool = False
    graph: bool = False  # a decode-only batch a whole-step CUDA graph replays (captured, not warmed here)

    @property
    def query_lens(self) -> list[int]:
        return [q for q, _ in self.prefills] + [1] * self.num_decodes

    @property
    def seq_lens(self) -> list[int]:
        return [s for _, s in self.prefills] + [self.decode_seq_len] * self.num_decodes

    @property
    def num_reqs(self) -> int:
        return len(self.prefills) + self.num_decodes

    @property
    def num_tokens(self) -> int:
        return sum(q for q, _ in self.prefills) + self.num_decodes

    @property
    def num_decode_rows(self) -> int:
        """Requests with query_len 1: the ones the attention's decode launch serves (and splits)."""
        return self.num_decodes + sum(q == 1 for q, _ in self.prefills)

    @property
    def max_query_len(self) -> int:
        return max([q for q, _ in self.prefills] + [1] * bool(self.num_decodes), default=0)

    @property
    def max_seq_len(self) -> int:
        return max([s for _, s in self.prefills] + [self.decode_seq_len] * bool(self.num_decodes), default=0)

    @property
    def cost(self) -> tuple[int, int]:
        """What running it costs, roughly: rows, then keys read."""
        return self.num_tokens, sum(s for _, s in self.prefills) + self.num_decodes * self.decode_seq_len


def _prefill(*lens: int, decodes: int = 0) -> WarmupStep:
    """Prompts of these lengths, each computed whole, then decodes of one-token sequences (each
    query attends to itself)."""
    return WarmupStep(tuple((n, n) for n in lens), num_decodes=decodes, decode_seq_len=1)


# The fixed shapes, for the matmuls and the layer paths of small eager steps.
WARMUP_STEPS: tuple[WarmupStep, ...] = (
    _prefill(1),  # a one-token prefill: every matmul one row, outside the graphs
    _prefill(3),  # a 3-token prefill: 3-row matmuls
    _prefill(4, decodes=2),  # a short prefill chunk with two decodes: a mixed batch of 6 rows
    _prefill(8),  # prefill attention tiles are sized by the longest chunk: 8 tokens take 32 rows,
    _prefill(16, decodes=1),  # 16 take 64 (a mixed batch of 17 rows, cuBLAS); the profile run compiled 128
)
# With --enforce-eager, decode-only steps run eagerly too: one request (the fused RoPE and
# deferred-norm path) and three, each with a 4-token context.
EAGER_DECODE_STEPS: tuple[WarmupStep, ...] = (
    WarmupStep(num_decodes=1, decode_seq_len=4, decode_only=True),
    WarmupStep(num_decodes=3, decode_seq_len=4, decode_only=True),
)


@dataclass(frozen=True, slots=True)
class StepLimits:
    """The bounds of the steps the scheduler can make."""

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    graph_sizes: tuple[int, ...] = ()  # the decode-only batch sizes captured as CUDA graphs


def _around_powers_of_two(limit: int) -> tuple[int, ...]:
    """1, 2, 3, every power of two and the number after it, and `limit`: all up to `limit`."""
    values = {1, 2, 3, limit}
    power = 4
    while power <= limit:
        values.update((power, power + 1))
        power *= 2
    return tuple(sorted(v for v in values if 1 <= v <= limit))


def _powers_of_two(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... and `limit`: all up to `limit`."""
    values = {limit} if limit >= 1 else set()
    power = 1
    while power <= limit:
        values.add(power)
        power *= 2
    return tuple(sorted(values))


def serving_steps(limits: StepLimits) -> Iterator[WarmupStep]:
    """The steps the warm-up chooses from, those where the kernels' choices change: tiles change
    where a chunk's rows pass a power of two (a chunk of each length around one), split counts
    where a context does and as the number of decodes grows (each power of two with 0, 1, 2, 4, ...
    decodes), and a decode-only batch's tiles and split count with its size (every size, at the
    longest context, where the split count is largest; the smallest sizes at every context).
    tests/engine/test_kernel_warmup.py checks that every step of a denser set adds no variant."""
    lengths = _powers_of_two(limits.max_model_len)
    chunk_limit = min(limits.max_num_batched_tokens, limits.max_model_len)
    for chunk in _around_powers_of_two(chunk_limit):
        if chunk < 2:  # a batch whose every query_len is 1 is decode-only
            continue
        yield WarmupStep(((chunk, chunk),))
        for decodes in _powers_of_two(min(limits.max_num_seqs - 1, limits.max_num_batched_tokens - chunk)):
            for seq_len in lengths:
                yield WarmupStep(((chunk, chunk),), decodes, seq_len)
    max_decodes = min(limits.max_num_seqs, limits.max_num_batched_tokens)
    for decodes in range(1, max_decodes + 1):
        yield WarmupStep(num_decodes=decodes, decode_seq_len=limits.max_model_len, decode_only=True)
    for decodes in _around_powers_of_two(min(max_decodes, 16)):
        for seq_len in lengths:
            yield WarmupStep(num_decodes=decodes, decode_seq_len=seq_len, decode_only=True)


StepVariants = Callable[[WarmupStep], frozenset[Hashable]]


def plan_warmup_steps(
    limits: StepLimits, variants: StepVariants | None = None, eager_decode: bool = False
) -> list[WarmupStep]:
    """The fixed steps that fit, then (given `variants`, the kernel variants a step launches) a
    few steps that together launch every variant of `serving_steps` that neither those nor the
    graph capture launched: a greedy set cover, most new variants first, then the cheapest."""
    fixed = WARMUP_STEPS + (EAGER_DECODE_STEPS if eager_decode else ())
    steps = [step for step in fixed if step.max_seq_len <= limits.max_model_len]
    if variants is None:
        return steps
    captured = [
        WarmupStep(num_decodes=size, decode_seq_len=limits.max_model_len, decode_only=True, graph=True)
        for size in limits.graph_sizes
    ]
    covered = frozenset().union(*(variants(step) for step in steps + captured))
    # The cheapest step for each set of variants still to compile.
    options: dict[frozenset[Hashable], WarmupStep] = {}
    for step in serving_steps(limits):
        new = variants(step) - covered
        if new and (new not in options or step.cost < options[new].cost):
            options[new] = step
    needed = frozenset().union(*options)
    while needed:
        new, step = max(options.items(), key=lambda item: (len(item[0] & needed), _negated(item[1].cost)))
        steps.append(step)
        needed -= new
    return steps


def _negated(cost: tuple[int, int]) -> tuple[int, int]:
    return -cost[0], -cost[1]


def attention_variants(runner, piecewise_size: Callable[[WarmupStep], int | None]) -> StepVariants | None:
    """The paged-attention kernel variants a step of this runner launches in any of its layers,
    or None when its attention backend does not say (`kernel_variants`). A step that runs through
    piecewise graphs (`piecewise_size`) does not fuse RoPE into a decode-only launch."""
    kernel_variants = getattr(runner.attn_backend, "kernel_variants", None)
    if kernel_variants is None:
        return None
    from tokenmill.attention.backend import PLAIN_ATTENTION
    from tokenmill.model.layers.attention import SelfAttention

    # One layer of each kind: its window (which also bounds its split count), soft cap and sinks.
    layers = {}
    for module in runner.model.modules():
        if isinstance(module, SelfAttention):
            spec = module.layer_spec
            layers.setdefault((spec.sliding_window, spec.logits_soft_cap, spec.sinks is None), spec)
    fuses = bool(getattr(runner.model, "fuse_decode_rope", False))
    return step_variants(
        kernel_variants,
        list(layers.values()) or [PLAIN_ATTENTION],
        kv_cache_dtype=runner.kv_cache_dtype,
        device=runner.device,
        fused_rope=lambda step: fuses and piecewise_size(step) is None,
    )


def step_variants(
    kernel_variants,
    layers: list,
    *,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
    fused_rope: Callable[[WarmupStep], bool],
) -> StepVariants:
    """`variants(step)` from an attention backend's `kernel_variants` over these layer specs;
    `fused_rope(step)`: whether the model would call forward_decode_with_rope for that step
    where the backend supports it (not inside piecewise graphs)."""
    cache: dict[tuple[int, int, int, int, bool, bool], frozenset[Hashable]] = {}

    def variants(step: WarmupStep) -> frozenset[Hashable]:
        facts = (
            step.num_reqs, step.num_decode_rows, step.max_query_len, step.max_seq_len, step.decode_only,
            fused_rope(step),
        )  # fmt: skip
        found = cache.get(facts)
        if found is None:
            num_reqs, num_decodes, max_query_len, max_seq_len, decode_only, fused = facts
            found = cache[facts] = frozenset(
                variant
                for layer in layers
                for variant in kernel_variants(
                    num_reqs=num_reqs,
                    num_decodes=num_decodes,
                    max_query_len=max_query_len,
                    max_seq_len=max_seq_len,
                    decode_only=decode_only,
                    kv_cache_dtype=kv_cache_dtype,
                    device=device,
                    layer=layer,
                    fused_rope=fused,
                )
            )
        return found

    return variants


def runner_limits(runner) -> StepLimits:
    scheduler = runner.config.scheduler
    graphs = runner.graph_runner
    return StepLimits(
        max_model_len=runner.max_model_len,
        max_num_seqs=scheduler.max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        graph_sizes=tuple(graphs.sizes) if graphs is not None else (),
    )


@torch.inference_mode()
def warm_up_eager_steps(runner) -> None:
    from tokenmill.worker.kv_cache import allocate_kv_caches
    from tokenmill.worker.scratch_step import scratch_step

    started = time.perf_counter()
    arch = runner.rank_arch  # this rank's KV heads (the whole model's when not tensor-parallel)
    device = runner.device
    piecewise = getattr(runner, "piecewise", None)

    def piecewise_size(step: WarmupStep) -> int | None:
        """The token count of the piecewise graphs ModelRunner.launch runs this step with, if any
        (a step no whole-step graph takes, up to the largest captured count)."""
        return None if piecewise is None or step.graph else piecewise.padded_size(step.num_tokens)

    variants = attention_variants(runner, piecewise_size)
    steps = plan_warmup_steps(runner_limits(runner), variants, eager_decode=runner.graph_runner is None)
    planned = time.perf_counter() - started
    if not steps:
        return
    caches = allocate_kv_caches(
        arch.num_layers,
        SCRATCH_BLOCKS,
        runner.block_size,
        arch.num_kv_heads,
        arch.head_dim,
        runner.kv_cache_dtype,
        device,
    )
    num_piecewise = 0
    for step in steps:
        positions, meta = scratch_step(
            step.query_lens,
            step.seq_lens,
            -(-step.max_seq_len // runner.block_size),
            device,
            step.decode_only,
            runner.kv_groups.num_groups,
            num_blocks=SCRATCH_BLOCKS,
        )
        size = piecewise_size(step)
        if size is None:
            input_ids = torch.zeros(meta.num_actual_tokens, dtype=torch.long, device=device)
            hidden = runner.model(input_ids, positions, caches, meta)
        else:
            hidden = _run_piecewise(runner, size, positions, meta)
            num_piecewise += 1
        last_rows = (meta.query_start_loc[1:] - 1).long()
        logits = runner.model.compute_logits(hidden[last_rows])
        if logits.is_cuda:  # as ModelRunner._sample does for a batch of greedy requests
            from tokenmill.kernels.triton.greedy import greedy_sample

            greedy_sample(logits)
    if device.type == "cuda":
        torch.cuda.synchronize()
    del caches
    num_variants = len(frozenset().union(*map(variants, steps))) if variants is not None else 0
    logger.info(
        "warmed up %d step shapes (%d through piecewise graphs; %d attention kernel variants, planned "
        "in %.3f s) in %.1f s",
        len(steps),
        num_piecewise,
        num_variants,
        planned,
        time.perf_counter() - started,
    )


def _run_piecewise(runner, size: int, positions: torch.Tensor, meta) -> torch.Tensor:
    """The step through the runner's piecewise graphs, as ModelRunner.launch runs it: the pieces
    read the staged token inputs (zero ids, these positions, slot -1: no K/V written anywhere);
    attention runs eagerly with `meta` on the engine's KV pool, whose blocks it only reads."""
    buffers = runner.buffers
    num_tokens = meta.num_actual_tokens
    buffers.input_ids[:size].zero_()
    buffers.positions[:size].zero_()
    buffers.positions[:num_tokens].copy_(positions)
    buffers.slot_mapping[:size].fill_(-1)
    for slots in buffers.group_slot_mapping:
        slots[:size].fill_(-1)
    return runner.piecewise.run(size, num_tokens, meta)
