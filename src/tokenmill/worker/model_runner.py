"""Runs one scheduler step on the model: flattened batch in, sampled tokens out.

The runner keeps its own state per request (`RequestStates`), built from the scheduler output's
new-request data and diffs and from the tokens it samples; it never sees the scheduler's requests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend
from tokenmill.config import EngineConfig
from tokenmill.core.kv_cache_groups import plan_kv_cache_groups
from tokenmill.core.kv_connector_metadata import KVConnectorMetadata
from tokenmill.core.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from tokenmill.device import resolve_device, resolve_dtype
from tokenmill.distributed import parallel_state
from tokenmill.model.arch import ArchConfig
from tokenmill.model.registry import ResolvedModel, load_model
from tokenmill.model.tensor_parallel import rank_arch
from tokenmill.sample.grammar_mask import GrammarMasker
from tokenmill.sample.metadata import RowSamplingInfo, SamplingMetadata, make_generator
from tokenmill.sample.rejection_sampler import VerifyLayout, verify_drafts
from tokenmill.sample.sampler import Sampler, SamplerOutput, compute_token_logprobs, greedy_argmax
from tokenmill.worker.batch_inputs import HostBatch, build_host_batch, pad_to_uniform_query
from tokenmill.worker.kv_cache import (
    allocate_kv_caches,
    check_kv_cache_dtype_on_device,
    kv_bytes_per_block,
    layer_kv_caches,
    num_blocks_for_cpu,
    resolve_kv_cache_dtype,
)
from tokenmill.worker.kv_connector import KVConnectorWorker, make_kv_connector_worker
from tokenmill.worker.request_state import RequestState, RequestStates
from tokenmill.worker.speculation import PendingVerifyStep, Speculator

logger = logging.getLogger(__name__)


def _wait_for(event: torch.cuda.Event) -> None:
    """The step's one sync. Exempt from torch.cuda.set_sync_debug_mode, so a test can run steps in
    "error" mode and have any other sync raise."""
    mode = torch.cuda.get_sync_debug_mode()
    if not mode:
        event.synchronize()
        return
    torch.cuda.set_sync_debug_mode(0)
    try:
        event.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class PendingStep:
    """A launched step: the sampled ids are on their way to the host. `result()` waits for them.

    With async scheduling the engine launches the next step before calling `result()` on this
    one, so the host work of both overlaps the device's.
    """

    def __init__(
        self,
        output: ModelRunnerOutput,
        sampling_states: list[RequestState] | None = None,
        packed: torch.Tensor | None = None,
        ready: torch.cuda.Event | None = None,
        sampled: SamplerOutput | None = None,
        metadata: SamplingMetadata | None = None,
        on_result: Callable[[ModelRunnerOutput], None] | None = None,
    ) -> None:
        self._output = output
        # Runs once the tokens are on the host (speculative decoding proposes the next drafts).
        self._on_result = on_result
        # The sampling requests' states (not ids): a token reaches the state it was sampled for,
        # even if the runner dropped that state since (ended, preempted) and an id was reused.
        self._sampling_states = sampling_states or []
        self._packed = packed  # [2, rows] on the host: sampled ids, then non-finite flags
        self._ready = ready
        self._sampled = sampled
        self._metadata = metadata

    def result(self) -> ModelRunnerOutput:
        output = self._output
        if self._packed is None:
            return output
        if self._ready is not None:
            _wait_for(self._ready)
        token_ids, bad_rows = self._packed.tolist()
        self._packed = None
        logprob_rows = None
        if self._sampled is not None and self._metadata is not None:
            logprob_rows = self._sampled.to_token_logprobs(self._metadata)
        states = self._sampling_states
        if not any(bad_rows):  # the common case, in comprehensions: this runs every step
            output.req_ids = [state.request_id for state in states]
            output.sampled_token_ids = [[token_id] for token_id in token_ids]
            for state, token_id in zip(states, token_ids, strict=True):
                state.token_ids.append(token_id)  # the runner's own token history
        else:
            for i, state in enumerate(states):
                if bad_rows[i]:
                    output.errored[state.request_id] = (
                        "the model produced non-finite (NaN or inf) logits for this request"
                    )
                    continue
                token_id = token_ids[i]
                state.token_ids.append(token_id)
                output.req_ids.append(state.request_id)
                output.sampled_token_ids.append([token_id])
        if logprob_rows is not None:
            output.logprobs = [
                [lp] if lp is not None else None for i, lp in enumerate(logprob_rows) if not bad_rows[i]
            ]
        if self._on_result is not None:
            self._on_result(output)
        return output


@dataclass(slots=True)
class _DeferredSample:
    """A constrained step between its phases: the logits are launched, sampling waits for the mask."""

    requests: list[RequestState]
    batch: HostBatch
    output: ModelRunnerOutput
    logits: torch.Tensor
    sampling_reqs: list[RequestState]


class ModelRunner:
    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int) -> None:
        self.config = config
        self.resolved = resolved
        self.arch = resolved.arch
        # What this rank's attention and KV pool hold: its share of the heads (all of them on one rank).
        self.tp_size = parallel_state.tp_size()
        self.rank_arch = rank_arch(self.arch, self.tp_size)
        self.max_model_len = max_model_len
        self.block_size = config.cache.block_size
        # Layers grouped by attention type for the KV cache; the scheduler builds the same plan.
        self.kv_groups = plan_kv_cache_groups(self.arch.num_layers, self.arch.sliding_windows, max_model_len)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        # The KV store and attention kernels read the element type from the cache tensors.
        self.attn_backend = self._make_attention_backend(config.attention_backend)
        self.kv_cache_dtype = (
            # A GGUF checkpoint's weights are quantized blocks: the backend may pick a narrower cache.
            self.attn_backend.auto_kv_cache_dtype(self.dtype, quantized_weights=resolved.format == "gguf")
            if config.cache.kv_cache_dtype == "auto"
            else resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)
        )
        check_kv_cache_dtype_on_device(self.kv_cache_dtype, self.device)
        if not self.attn_backend.supports_kv_cache_dtype(self.kv_cache_dtype, self.dtype):
            self.attn_backend = self._reference_for_kv_cache_dtype(config.attention_backend)
        started = time.perf_counter()
        self.model = load_model(
            config.model, resolved.arch, self.device, self.dtype, self.attn_backend, resolved=resolved,
            kernel=config.kernel,
        )  # fmt: skip
        self._check_attention_layers()
        self._assign_kv_groups()
        self._assign_layer_indices()
        logger.info(
            "model loaded in %.1f s (%s, %s, %s)",
            time.perf_counter() - started,
            resolved.format,
            self.device,
            self.dtype,
        )
        # Multi-LoRA: wraps the adaptable layers' methods; owns the adapter slots (None: LoRA off).
        self.lora = self._make_lora_manager() if config.lora is not None else None
        # CUDA graphs without and with LoRA (a step replays the first unless a token has an adapter).
        self._graph_variants: dict[bool, tuple] = {}
        self.sampler = Sampler()
        # Speculative decoding: proposes drafts after each step (None: off).
        self.speculator = Speculator(config.speculative, self) if config.speculative is not None else None
        self.grammar_masker = GrammarMasker(self.device)
        # A step with constrained requests between its two phases: launched up to the logits, it
        # waits for `sample_tokens(grammar_output)`.
        self._awaiting_grammar: _DeferredSample | None = None
        self.requests = RequestStates()
        # Per-request RNGs of seeded requests; kept across a preemption (the stream goes on), dropped
        # when the request ends.
        self.generators: dict[str, torch.Generator] = {}
        self._staged_sample_rows: torch.Tensor | None = None
        # Verification steps (speculative decoding): staging buffers, grown on demand.
        self._verify_host: torch.Tensor | None = None
        self._verify_dev: torch.Tensor | None = None
        self._verify_result_host: torch.Tensor | None = None
        # The last step's sampled ids (device) and each sampling request's row in them: the next
        # step may be launched before the host sees them (async scheduling) and feeds them in.
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        self._num_sample_fetches = 0
        self.kv_caches: list[torch.Tensor] = []  # per model layer (layers of different groups share tensors)
        self.kv_bytes_per_block = 0  # one block over the pool's layer tensors (without a drafter's)
        self.kv_connector: KVConnectorWorker | None = None  # e.g. the host KV tier (--kv-offload-gb)
        # The connector while a step that moves KV is being launched: its per-layer hooks go into
        # that step's attention metadata.
        self._kv_layer_hooks: KVConnectorWorker | None = None
        self.kv_cache_tensors: list[torch.Tensor] = []  # the pool: one per layer of a group
        self.num_blocks = 0
        self.buffers = None  # InputBuffers on CUDA
        self.graph_runner = None  # CudaGraphRunner once captured
        self.piecewise = None  # PiecewiseGraphs once captured
        self.max_blocks_per_req = -(-max_model_len // self.block_size)
        if self.device.type == "cuda":
            from tokenmill.worker.input_buffers import InputBuffers

            sched = config.scheduler
            self.buffers = InputBuffers(
                max(sched.max_num_batched_tokens, sched.max_num_seqs),
                sched.max_num_seqs,
                self.max_blocks_per_req,
                self.device,
                num_kv_groups=self.kv_groups.num_groups,
            )

    def _make_lora_manager(self):  # noqa: ANN202 - a LoRAManager
        from tokenmill.worker.cuda_graphs import MAX_TOKENS_PER_REQUEST
        from tokenmill.worker.lora.manager import LoRAManager

        sched = self.config.scheduler
        max_tokens = max(sched.max_num_batched_tokens, sched.max_num_seqs * MAX_TOKENS_PER_REQUEST)
        return LoRAManager(self.config.lora, self.model, self.arch, self.device, self.dtype, max_tokens)

    def _set_lora_mapping(self, requests: list[RequestState], batch: HostBatch) -> None:
        """The step's token -> adapter slot mapping, which every LoRA layer reads (adapters are
        copied into slots as needed, on the step's stream)."""
        lora = self.lora
        assert lora is not None
        loras = [r.lora_request for r in requests]
        if not any(loras):  # a base-only step: nothing to map, no slot to keep
            lora.mapping.clear()
            return
        slots = lora.slots_for(loras, self.requests.lora_ids())
        num_reqs = len(requests)
        tokens_per_req = np.diff(batch.query_start_loc[: num_reqs + 1])
        lora.mapping.set(np.repeat(slots, tokens_per_req))

    def _use_graph_variant(self, requests: list[RequestState]) -> None:
        """The CUDA graphs of the step's kind: with the LoRA kernels if a request has an adapter."""
        if self._graph_variants:
            with_lora = any(r.lora_request is not None for r in requests)
            self.graph_runner, self.piecewise = self._graph_variants[with_lora]

    def _reference_for_kv_cache_dtype(self, chosen: str) -> AttentionBackend:
        """The torch reference backend, for a KV cache dtype the chosen backend cannot keep (the C++
        CPU kernels read 16- and 32-bit caches, not scaled FP8): taken, with a log line, when the
        backend was `auto`; otherwise an error naming the options that work."""
        cache, model = str(self.kv_cache_dtype).removeprefix("torch."), str(self.dtype).removeprefix("torch.")
        reference = None if self.attn_backend.name == "torch" else self._make_attention_backend("torch")
        usable = reference is not None and reference.supports_kv_cache_dtype(self.kv_cache_dtype, self.dtype)
        if chosen == "auto" and usable:
            logger.info(
                "attention backend: torch, since the %s backend cannot keep a %s KV cache",
                self.attn_backend.name, cache,
            )  # fmt: skip
            return reference
        hint = " or --attention-backend torch" if usable else ""
        raise ValueError(
            f"the {self.attn_backend.name} attention backend cannot keep a {cache} KV cache for a {model} "
            f"model; use kv_cache_dtype=auto{hint}"
        )

    def _make_attention_backend(self, name: str) -> AttentionBackend:
        return self.make_attention_backend(name, self.rank_arch)

    def make_attention_backend(self, name: str, arch: ArchConfig) -> AttentionBackend:
        """An attention backend for a model of `arch` on this runner's device and block size (the
        target's, or a draft model's)."""
        backend_cls = get_attention_backend(name, self.device)
        return backend_cls(
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
            arch.attention_scale,
            self.block_size,
            kernel=self.config.kernel,
        )

    def _check_attention_layers(self) -> None:
        """Every layer's sliding window / soft cap / sinks must be honoured by the backend: refuse
        at load, naming the layer and the feature, rather than approximate them."""
        from tokenmill.model.layers.attention import SelfAttention

        for name, module in self.model.named_modules():
            if isinstance(module, SelfAttention):
                self.attn_backend.check_layer_spec(
                    module.layer_spec, where=f"{self.arch.architecture} layer {name}"
                )

    def _assign_kv_groups(self) -> None:
        """Tell each attention layer which KV cache group's block tables it uses. The model's
        SelfAttention modules come in layer order (the order of its per-layer cache list)."""
        if self.kv_groups.num_groups == 1:
            return  # every layer is in group 0, SelfAttention's default
        from tokenmill.model.layers.attention import SelfAttention

        layers = [m for m in self.model.modules() if isinstance(m, SelfAttention)]
        if len(layers) != self.kv_groups.num_layers:
            raise ValueError(
                f"{self.arch.architecture} has {len(layers)} SelfAttention modules but "
                f"{self.kv_groups.num_layers} layers; KV cache groups (sliding-window layers) need the "
                "model's attention layers to be SelfAttention modules, one per layer, in layer order"
            )
        for layer, group in zip(layers, self.kv_groups.layer_group, strict=True):
            layer.kv_group = group

    def _assign_layer_indices(self) -> None:
        """Number the attention layers (their place in the per-layer cache list) for a KV
        connector's per-layer hooks; SelfAttention modules come in layer order."""
        from tokenmill.model.layers.attention import SelfAttention

        for index, layer in enumerate(m for m in self.model.modules() if isinstance(m, SelfAttention)):
            layer.layer_index = index

    # -- memory -------------------------------------------------------------------------------

    def initialize_kv_cache(self) -> int:
        """Size and allocate the KV pool; returns the number of blocks."""
        groups = self.kv_groups
        per_block = kv_bytes_per_block(
            groups.num_tensors, self.block_size, self.rank_arch.num_kv_heads, self.arch.head_dim,
            self.kv_cache_dtype,
        )  # fmt: skip
        self.kv_bytes_per_block = per_block
        drafter = self.speculator.draft_model if self.speculator is not None else None
        if drafter is not None:  # its cache shares the block tables: one pool, both caches per block
            per_block += drafter.kv_bytes_per_block()
        max_chunk = min(self.config.scheduler.max_num_batched_tokens, self.max_model_len)
        min_blocks = groups.blocks_for_one_sequence(self.max_model_len, self.block_size, max_chunk)
        if self.device.type == "cuda":
            from tokenmill.worker.gpu_memory import num_blocks_for_gpu

            num_blocks = num_blocks_for_gpu(self, per_block, min_blocks)
        else:
            num_blocks = num_blocks_for_cpu(self.config.cache, per_block, min_blocks)
        # Each tensor-parallel rank sized its own pool; the scheduler's block ids must fit every one.
        num_blocks = parallel_state.min_over_ranks(num_blocks)
        self.kv_cache_tensors = allocate_kv_caches(
            groups.num_tensors, num_blocks, self.block_size, self.rank_arch.num_kv_heads, self.arch.head_dim,
            self.kv_cache_dtype, self.device,
        )  # fmt: skip
        self.kv_caches = layer_kv_caches(self.kv_cache_tensors, groups)
        self.kv_connector = make_kv_connector_worker(
            self.config.cache, groups, self.kv_cache_tensors, self.kv_bytes_per_block,
            self.config.model.served_model_name or self.config.model.model or "",
        )  # fmt: skip
        if drafter is not None:
            drafter.allocate_kv_cache(num_blocks)
        self.num_blocks = num_blocks
        if groups.has_sliding or groups.num_groups > 1:
            logger.info("%s", groups.describe())
        if self.device.type == "cuda" and not self.config.enforce_eager:
            from tokenmill.worker.cuda_graphs import garbage_collection_paused

            with garbage_collection_paused():
                self.capture_cuda_graphs()
                if drafter is not None and hasattr(drafter, "capture_cuda_graphs"):
                    drafter.capture_cuda_graphs(self.speculator.policy.disable_by_batch_size)  # type: ignore[union-attr]
        if self.device.type == "cuda":
            from tokenmill.worker.kernel_warmup import warm_up_eager_steps

            warm_up_eager_steps(self)
            self._warm_up_grammar_mask()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %s), up to %d tokens in flight",
            num_blocks, self.block_size, num_blocks * per_block / 2**30,
            str(self.kv_cache_dtype).removeprefix("torch."), num_blocks * self.block_size,
        )  # fmt: skip
        return num_blocks

    @torch.inference_mode()
    def _warm_up_grammar_mask(self) -> None:
        """The structured-output mask kernel, at the width of the logits `compute_logits` returns."""
        hidden = torch.zeros((1, self.arch.hidden_size), dtype=self.dtype, device=self.device)
        width = self.model.compute_logits(hidden).shape[-1]
        if self.grammar_masker.warm_up(width):
            logger.debug("warmed up the grammar mask kernel for %d-token logits", width)

    def capture_cuda_graphs(self) -> None:
        from tokenmill.worker.cuda_graphs import MAX_TOKENS_PER_REQUEST

        if not self.attn_backend.supports_cuda_graphs:
            logger.warning(
                "the %s attention backend cannot be captured in CUDA graphs; running eagerly",
                self.attn_backend.name,
            )
            return
        # Speculative decoding: verification steps replay graphs of 1 + k rows per request (shorter
        # draft runs padded to it). With EAGLE-3 the graphs also keep the target's aux hidden states.
        speculator = self.speculator
        verify_q = ()
        if (
            speculator is not None
            and self.attn_backend.supports_multi_token_decode
            and 1 + speculator.k <= MAX_TOKENS_PER_REQUEST
        ):
            verify_q = (1 + speculator.k,)
        self.graph_runner, self.piecewise = self._capture_graph_set(verify_q)
        if self.lora is not None:
            # Steps with adapters replay graphs that hold the LoRA kernels (reading the slot mapping's
            # buffers); steps without replay these, which hold none.
            variants = {False: (self.graph_runner, self.piecewise)}
            self.lora.mapping.active = True
            try:
                variants[True] = self._capture_graph_set(verify_q)
            finally:
                self.lora.mapping.clear()
            self._graph_variants = variants
            self.graph_runner, self.piecewise = variants[False]

    def _capture_graph_set(self, verify_q: tuple[int, ...]) -> tuple:
        """Whole-step decode graphs and, where the family allows, piecewise graphs (or None)."""
        from tokenmill.worker.cuda_graphs import CudaGraphRunner

        graph_runner = CudaGraphRunner(
            self.model, self.attn_backend, self.buffers, self.kv_caches, self.config.scheduler.max_num_seqs,
            spec_tokens_per_request=(1, *verify_q),
            aux_layers=self.speculator.aux_layers if self.speculator is not None else None,
        )  # fmt: skip
        graph_runner.capture()
        if not self.config.kernel.piecewise_cuda_graphs:
            return graph_runner, None
        if not getattr(self.model, "supports_piecewise_graphs", False):
            logger.info(
                "%s steps with prefill chunks run eagerly (no piecewise CUDA graphs for this family)",
                type(self.model).__name__,
            )
            return graph_runner, None
        from tokenmill.worker.piecewise_graphs import PiecewiseGraphs

        piecewise = PiecewiseGraphs(
            self.model, self.attn_backend, self.buffers, self.kv_caches,
            self.config.scheduler.max_num_batched_tokens,
        )  # fmt: skip
        piecewise.capture()
        return graph_runner, piecewise

    def release(self) -> None:
        """Drop the graphs, KV pool and weights and return their memory to the device, so
        another model (a benchmark baseline) can use it in this process. The runner is unusable after."""
        self.graph_runner = None
        self.piecewise = None
        self._graph_variants = {}
        if self.lora is not None:
            self.lora.shutdown()
        self.kv_caches = []
        self.kv_cache_tensors = []
        if self.kv_connector is not None:
            self.kv_connector.release()
            self.kv_connector = None
        self.model = None  # type: ignore[assignment]
        self.buffers = None
        if self.device.type == "cuda":
            import gc

            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    # -- one step -----------------------------------------------------------------------------

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        return tensor if tensor.dtype == dtype else tensor.to(dtype)

    def build_metadata(
        self,
        batch: HostBatch,
        padded_reqs: int | None = None,
        padded_tokens: int | None = None,
        requests: list[RequestState] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Device inputs of a step. On CUDA they go through the persistent pinned buffers (padded to
        `padded_reqs` single-token requests for a CUDA-graph replay, or to `padded_tokens` token
        rows for piecewise graphs); on CPU they are numpy views. `requests` (the batch's, in order):
        with LoRA on, their tokens are mapped to their adapters' slots."""
        num_tokens = len(batch.input_ids)
        num_reqs = len(batch.seq_lens)
        if self.buffers is not None:
            self.buffers.begin_step()
            if self.lora is not None and requests is not None:
                self._set_lora_mapping(requests, batch)
            if padded_tokens is None:
                padded_tokens = num_tokens if padded_reqs is None else padded_reqs
            input_ids, positions, slot_mapping = self.buffers.stage_tokens(
                batch.input_ids, batch.positions, batch.slot_mapping, padded_tokens
            )
            query_start_loc, seq_lens, block_tables = self.buffers.stage_requests(
                batch.query_start_loc, batch.seq_lens, batch.block_tables, padded_reqs or num_reqs
            )
            extra_groups = [
                self.buffers.stage_kv_group(
                    group, slots, tables, padded_tokens, padded_reqs or num_reqs
                )
                for group, (slots, tables) in enumerate(
                    zip(batch.extra_slot_mappings, batch.extra_block_tables, strict=True), start=1
                )
            ]
            if padded_reqs is None and len(batch.sample_rows):
                self._staged_sample_rows = self.buffers.stage_sample_rows(batch.sample_rows)
            if batch.placeholder_rows:
                self._feed_last_sampled(batch, input_ids)
            self.buffers.end_staging()
        else:
            if self.lora is not None and requests is not None:
                self._set_lora_mapping(requests, batch)
            input_ids = self._to_device(batch.input_ids, torch.long)
            positions = self._to_device(batch.positions, torch.long)
            slot_mapping = self._to_device(batch.slot_mapping, torch.long)
            query_start_loc = self._to_device(batch.query_start_loc, torch.int32)
            seq_lens = self._to_device(batch.seq_lens, torch.int32)
            block_tables = self._to_device(batch.block_tables, torch.int32)
            extra_groups = [
                (self._to_device(tables, torch.int32), self._to_device(slots, torch.long))
                for slots, tables in zip(batch.extra_slot_mappings, batch.extra_block_tables, strict=True)
            ]
            if batch.placeholder_rows:
                self._feed_last_sampled(batch, input_ids)
        meta = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs if padded_reqs is None else padded_reqs,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            query_start_loc_cpu=torch.from_numpy(batch.query_start_loc),
            seq_lens_cpu=torch.from_numpy(batch.seq_lens),
            is_decode_only=batch.max_query_len == 1,
            # A verification step: its requests' last tokens and drafts as decodes of a few rows.
            multi_token_decode=batch.sampling_drafts is not None and self.attn_backend.supports_multi_token_decode,
            kv_layer_hooks=self._kv_layer_hooks,
        )
        if extra_groups:
            meta.with_kv_groups(extra_groups)
        return input_ids, positions, meta

    def _feed_last_sampled(self, batch: HostBatch, input_ids: torch.Tensor) -> None:
        """Copy the tokens the previous step sampled (still on the device) into this step's input."""
        if self._last_sampled is None:
            raise RuntimeError("a step needs the previous step's sampled tokens, but that step sampled none")
        sampled, row_of = self._last_sampled
        try:
            src_rows = [row_of[rid] for rid in batch.placeholder_req_ids]
        except KeyError as exc:
            raise RuntimeError(f"request {exc.args[0]} sampled no token in the previous step") from None
        dst_rows = batch.placeholder_rows
        k = len(dst_rows)
        if dst_rows[-1] == k - 1 and src_rows == dst_rows:  # steady decode: same requests, same order
            input_ids[:k].copy_(sampled[:k])
            return
        if self.buffers is not None:
            src, dst = self.buffers.stage_gather(np.asarray(src_rows), np.asarray(dst_rows))
        else:
            src, dst = torch.tensor(src_rows), torch.tensor(dst_rows)
        input_ids.index_copy_(0, dst, sampled.index_select(0, src))

    def _generator_for(self, state: RequestState) -> torch.Generator | None:
        seed = state.sampling_params.seed
        if seed is None:
            return None
        generator = self.generators.get(state.request_id)
        if generator is None:
            generator = make_generator(seed, self.device)
            self.generators[state.request_id] = generator
        return generator

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its results. A step with constrained requests needs its
        grammar bitmask: the engine runs those through execute_async and sample_tokens."""
        pending = self.execute_async(so)
        if pending is None:
            self._awaiting_grammar = None
            raise RuntimeError(
                "the step has structured-output requests: run it with execute_async() and then "
                "sample_tokens(grammar_output)"
            )
        return pending.result()

    @torch.inference_mode()
    def execute_async(self, so: SchedulerOutput) -> PendingStep | None:
        """Launch one step; its sampled ids come back through the returned PendingStep.

        A step that lists structured-output requests stops after the logits and returns None:
        `sample_tokens(grammar_output)` masks them and samples (the first phase's device work
        overlaps the host's mask fill).
        """
        self._awaiting_grammar = None  # a step whose second phase never came (it failed) is dropped
        for req_id in so.finished_req_ids:
            self.generators.pop(req_id, None)
        if self.speculator is not None:
            for req_id in so.finished_req_ids | so.preempted_req_ids:
                self.speculator.forget(req_id)
        requests = self.requests.update(so)
        if so.kv_connector_metadata is None:
            return self.launch(so, requests)
        # The connector's copies start now and overlap the forward: each attention layer waits for
        # its own (meta.kv_layer_hooks, set by build_metadata); whatever the forward did not wait
        # for (a whole-step graph, a step without a forward) is waited for at the end.
        connector = self._required_connector()
        try:
            connector.start_load_kv(so.kv_connector_metadata)
            self._kv_layer_hooks = connector
            return self.launch(so, requests)
        finally:
            self._kv_layer_hooks = None
            connector.wait_for_load()  # after a failed step too: no copy outlives its step

    def run_kv_connector(self, metadata: KVConnectorMetadata) -> None:
        """The KV connector's copies between steps, with no forward (a producer's sends)."""
        connector = self._required_connector()
        connector.start_load_kv(metadata)
        connector.wait_for_load()

    def _required_connector(self) -> KVConnectorWorker:
        if self.kv_connector is None:
            raise RuntimeError("got KV connector metadata but this runner has no KV connector")
        return self.kv_connector

    def _wait_for_all_kv_layers(self) -> None:
        """Before a whole-step CUDA graph replay, which calls no per-layer hook."""
        if self._kv_layer_hooks is not None:
            self._kv_layer_hooks.wait_for_load()

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingStep:
        """The second phase of a constrained step: mask the waiting logits and sample."""
        deferred = self._awaiting_grammar
        if deferred is None:
            raise RuntimeError("sample_tokens() without a step waiting for its grammar bitmask")
        self._awaiting_grammar = None
        logits = deferred.logits
        nonfinite = None
        if grammar_output is not None and not grammar_output.is_empty:
            # Non-finite logits are the model's fault only before the mask's -inf.
            nonfinite = ~torch.isfinite(logits.sum(dim=-1))
            row_of: dict[str, int] = {}
            for i, r in enumerate(deferred.sampling_reqs):  # a request verifying drafts has several rows
                row_of.setdefault(r.request_id, i)
            self.grammar_masker.apply(logits, grammar_output, row_of)
        return self._sample(
            deferred.requests, deferred.batch, None, deferred.output, logits=logits, nonfinite=nonfinite
        )

    def _sample_or_wait(
        self,
        so: SchedulerOutput,
        requests: list[RequestState],
        batch: HostBatch,
        hidden: torch.Tensor | None,
        output: ModelRunnerOutput,
        logits: torch.Tensor | None = None,
    ) -> PendingStep | None:
        if not so.structured_output_request_ids:
            return self._sample(requests, batch, hidden, output, logits=logits)
        if logits is None:
            logits = self._compute_sample_logits(batch, hidden)
        sampling_reqs = [requests[i] for i in batch.sampling_req_indices]
        self._awaiting_grammar = _DeferredSample(requests, batch, output, logits, sampling_reqs)
        return None

    def _compute_sample_logits(self, batch: HostBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        assert hidden is not None
        if self.buffers is not None:
            rows = self._staged_sample_rows
        else:
            rows = torch.from_numpy(batch.sample_rows)
        # lm_head only on the rows that sample: a prefill chunk needs one row, not thousands.
        return self.model.compute_logits(hidden[rows])

    def launch(self, so: SchedulerOutput, requests: list[RequestState]) -> PendingStep | None:
        """Build, run and sample the step whose request states are already updated (a step with
        constrained requests stops after the logits: see execute_async)."""
        output = ModelRunnerOutput()
        if not requests:
            return PendingStep(output)
        if self.lora is not None:
            self._use_graph_variant(requests)
        num_computed_tokens = so.batch_num_computed_tokens()  # batch order, as the requests
        num_scheduled_tokens = list(so.num_scheduled_tokens.values())
        drafts = None
        if so.scheduled_spec_decode_tokens:
            spec = so.scheduled_spec_decode_tokens
            drafts = [spec.get(r.request_id, []) for r in requests]
        # EAGLE-3 reads the target's aux hidden states: kept by the decode graphs, and by eager
        # forwards for the other steps (no piecewise graphs: they do not keep them).
        needs_aux = self.speculator is not None and self.speculator.needs_aux_hidden_states
        graph_key = self._graph_key(so, requests, num_computed_tokens)
        if graph_key is not None:
            # Decode step (q tokens per request, q = 1 + k for a verification step): pad to a
            # captured batch size and replay its graph.
            padded_reqs, q = graph_key
            num_reqs = len(requests)
            batch = build_host_batch(
                requests,
                num_computed_tokens,
                num_scheduled_tokens,
                self.block_size,
                block_table_width=self.max_blocks_per_req,
                drafts=drafts,
                tables=self.requests.tables,
            )
            if drafts is not None and len(batch.input_ids) != num_reqs * q:
                # Drafts of different lengths: each request's rows padded to the graph's q.
                batch = pad_to_uniform_query(batch, q)
            self.build_metadata(batch, padded_reqs=padded_reqs, padded_tokens=padded_reqs * q, requests=requests)
            output.cuda_graph_size = padded_reqs
            # Logits PER ROW, not per request: [num_reqs * q, vocab] in the step's row order, request
            # i's q query tokens at rows i*q .. i*q + q - 1 (for q = 1, one row per request).
            self._wait_for_all_kv_layers()
            logits = self.graph_runner.replay(graph_key, num_reqs * q)  # type: ignore[union-attr]
            if needs_aux:
                aux = self.graph_runner.aux_hidden_states(graph_key, num_reqs * q)  # type: ignore[union-attr]
                self.speculator.keep_step_aux(batch, aux)  # type: ignore[union-attr]
            if drafts is not None:
                # A verification step samples the rows of each request's last token and drafts.
                if len(batch.sample_rows) != num_reqs * q:
                    rows = self.buffers.stage_sample_rows(batch.sample_rows)  # type: ignore[union-attr]
                    logits = logits.index_select(0, rows)
            elif q > 1:
                # Until verification takes every row, a sampling request samples from its last row
                # (the row an eager step would sample), as build_host_batch's sample_rows say.
                last_rows = logits.view(num_reqs, q, -1)[:, -1]
                if len(batch.sampling_req_indices) < num_reqs:
                    index = torch.from_numpy(np.asarray(batch.sampling_req_indices, dtype=np.int64))
                    last_rows = last_rows.index_select(0, index.to(self.device, non_blocking=True))
                logits = last_rows
            return self._sample_or_wait(so, requests, batch, None, output, logits=logits)
        batch = build_host_batch(
            requests,
            num_computed_tokens,
            num_scheduled_tokens,
            self.block_size,
            drafts=drafts,
            tables=self.requests.tables,
        )
        piecewise = None if needs_aux else self.piecewise
        size = piecewise.padded_size(so.total_num_scheduled_tokens) if piecewise is not None else None
        if size is not None:
            # Graphs between the attention calls, attention itself eager (worker/piecewise_graphs.py).
            _, _, meta = self.build_metadata(batch, padded_tokens=size, requests=requests)
            output.cuda_graph_size = size
            hidden = piecewise.run(size, so.total_num_scheduled_tokens, meta)
        else:
            input_ids, positions, meta = self.build_metadata(batch, requests=requests)
            if needs_aux:
                hidden = self.speculator.target_forward(input_ids, positions, self.kv_caches, meta, batch)  # type: ignore[union-attr]
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)
        # Syncs: the engine does not overlap steps with prompt logprobs.
        self._prompt_logprobs(requests, num_computed_tokens, num_scheduled_tokens, batch, hidden, output)
        if batch.sampling_req_indices:
            return self._sample_or_wait(so, requests, batch, hidden, output)
        self._last_sampled = None
        return PendingStep(output, on_result=self._after_step(requests, batch))

    def _graph_key(
        self, so: SchedulerOutput, requests: list[RequestState], num_computed_tokens: list[int]
    ) -> tuple[int, int] | None:
        """The captured graph (padded batch size, tokens per request q) that runs this step, if any:
        steps where every request computes the same q tokens past its prompt, q = 1 or one of the
        graph runner's spec_tokens_per_request (a verification step's 1 + k)."""
        graphs = self.graph_runner
        if graphs is None:
            return None
        num_reqs = len(requests)
        if so.scheduled_spec_decode_tokens:
            return self._verify_graph_key(so, requests, num_computed_tokens)
        q, remainder = divmod(so.total_num_scheduled_tokens, num_reqs)
        if remainder or q not in graphs.sizes_by_q:
            return None
        if q > 1 and any(n != q for n in so.num_scheduled_tokens.values()):
            return None
        if not all(start >= r.num_prompt_tokens for r, start in zip(requests, num_computed_tokens, strict=True)):
            return None
        return graphs.graph_key(num_reqs, q)

    def _verify_graph_key(
        self, so: SchedulerOutput, requests: list[RequestState], num_computed_tokens: list[int]
    ) -> tuple[int, int] | None:
        """A verification step replays the graph of the smallest captured q that holds every
        request's last token and drafts (shorter ones padded: pad_to_uniform_query), when every
        request decodes and the padding stays inside max_model_len."""
        graphs = self.graph_runner
        assert graphs is not None
        longest = max(so.num_scheduled_tokens.values())
        q = min((n for n in graphs.sizes_by_q if n >= longest), default=None)
        if q is None or q == 1 or self.kv_groups.num_groups > 1:
            return None
        for r, start in zip(requests, num_computed_tokens, strict=True):
            if start < r.num_prompt_tokens or start + q > self.max_model_len:
                return None
        return graphs.graph_key(len(requests), q)

    def _sample(
        self,
        requests: list[RequestState],
        batch: HostBatch,
        hidden: torch.Tensor | None,
        output: ModelRunnerOutput,
        logits: torch.Tensor | None = None,
        nonfinite: torch.Tensor | None = None,
    ) -> PendingStep:
        """Sample the step's logits. `nonfinite` ([rows] bool): the model's non-finite rows, taken
        before a grammar mask put -inf into the logits (None: computed here from the logits)."""
        if logits is None:
            logits = self._compute_sample_logits(batch, hidden)
        if batch.sampling_drafts is not None:
            return self._verify(requests, batch, logits, output, nonfinite)
        sampling_reqs = [requests[i] for i in batch.sampling_req_indices]
        for r in sampling_reqs:
            r.num_tokens += 1  # its id reaches the host with PendingStep.result()
        metadata = None
        sampled = None
        packed = None
        if all(r.is_plain_greedy for r in sampling_reqs):
            # The common case (and every benchmark): one argmax, no per-row metadata to build.
            if logits.is_cuda and nonfinite is None:
                from tokenmill.kernels.triton.greedy import greedy_sample

                packed = greedy_sample(logits)  # ids and non-finite flags in two launches
                sampled_ids = packed[0]
            else:
                sampled_ids = greedy_argmax(logits)  # on the CPU the C++ kernel's, else torch's
        else:
            metadata = self._row_metadata(sampling_reqs, logits)
            sampled = self.sampler(logits, metadata)
            sampled_ids = sampled.sampled_token_ids
        # NaN / inf logits end only their own request; the flag rides along with the one host sync.
        # (A row's sum is finite exactly when all its logits are, and needs no [rows, vocab] mask.)
        if packed is None:
            if nonfinite is None:
                nonfinite = ~torch.isfinite(logits.sum(dim=-1))
            packed = torch.stack([sampled_ids, nonfinite.long()])
        if self.tp_size > 1:
            # Every rank sampled from the same gathered logits; rank 0's ids are the step's, and each
            # rank's next step feeds them (below), so none may follow its own RNG instead.
            packed = parallel_state.broadcast_from_driver(packed)
            sampled_ids = packed[0]
        self._last_sampled = (sampled_ids, {r.request_id: i for i, r in enumerate(sampling_reqs)})
        ready = None
        if self.buffers is not None:
            # Into pinned memory without waiting; two buffers in turn, since the next step's copy
            # may be queued before this one is read.
            n = packed.shape[1]
            host = self.buffers.sampled_host[self._num_sample_fetches % 2][: 2 * n].view(2, n)
            self._num_sample_fetches += 1
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            packed = host
        return PendingStep(output, sampling_reqs, packed, ready, sampled, metadata, self._after_step(requests, batch))

    def _after_step(self, requests: list[RequestState], batch: HostBatch) -> Callable[[ModelRunnerOutput], None] | None:
        """Speculative decoding: what proposes the next drafts once the step's tokens are on the host."""
        speculator = self.speculator
        if speculator is None:
            return None
        starts, lens = self._step_extents(batch)
        return lambda output: speculator.after_step(output, requests, starts, lens, None, batch)

    @staticmethod
    def _step_extents(batch: HostBatch) -> tuple[list[int], list[int]]:
        """Per request of the step: the first position it computed, and how many."""
        lens = np.diff(batch.query_start_loc)
        return (batch.seq_lens - lens).tolist(), lens.tolist()

    def _verify(
        self,
        requests: list[RequestState],
        batch: HostBatch,
        logits: torch.Tensor,
        output: ModelRunnerOutput,
        nonfinite: torch.Tensor | None,
    ) -> PendingVerifyStep:
        """Sample a step that verifies drafts (sample/rejection_sampler.py): each sampling request
        gets its accepted drafts and one more token; the ids come back through one host copy."""
        assert batch.sampling_drafts is not None
        row_states = [requests[i] for i in batch.sampling_req_indices]
        states: list[RequestState] = []
        for i, state in enumerate(row_states):
            if i == 0 or state is not row_states[i - 1]:
                states.append(state)
        drafts = batch.sampling_drafts
        layout = VerifyLayout.build(drafts, self.device, self._verify_staging(len(row_states), len(states)))
        metadata = None if all(r.is_plain_greedy for r in states) else self._row_metadata(row_states, logits)
        result = verify_drafts(logits, layout, metadata, nonfinite)
        self._last_sampled = None  # speculative decoding runs without async scheduling
        packed, ready = result.packed, None
        if self.tp_size > 1:
            # As in _sample: rank 0's accepted runs are the step's on every rank, so each rank's
            # token history (and its n-gram proposals, its draft policy) follows rank 0's.
            packed = parallel_state.broadcast_from_driver(packed.contiguous())
        if self.buffers is not None:
            host = self._verify_result_host[: packed.numel()].view(packed.shape)
            host.copy_(packed, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            packed = host
        speculator = self.speculator
        on_result = None
        if speculator is not None:
            starts, lens = self._step_extents(batch)

            def on_result(output: ModelRunnerOutput, verified: dict[str, tuple[int, int]]) -> None:
                speculator.after_step(output, requests, starts, lens, verified, batch)

        return PendingVerifyStep(output, states, drafts, result, packed, ready, metadata, on_result)

    def _verify_staging(self, num_rows: int, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Persistent pinned / device int64 buffers for a verification step's layout and results
        (pinned allocations per step would cost more than the step's sampling)."""
        if self.buffers is None:
            return None
        width = num_rows - num_reqs + 1  # at most this many rows per request
        needed = max(num_rows + 2 * num_reqs * width, num_reqs * (width + 2))
        if self._verify_dev is None or self._verify_dev.numel() < needed:
            size = max(needed, 4 * self.config.scheduler.max_num_seqs * 8)
            self._verify_host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
            self._verify_dev = torch.zeros(size, dtype=torch.int64, device=self.device)
            self._verify_result_host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        return self._verify_host, self._verify_dev

    def _row_metadata(self, row_states: list[RequestState], logits: torch.Tensor) -> SamplingMetadata:
        """Sampling metadata with one row per entry of `row_states` (a request verifying drafts has
        several rows, sharing its generator)."""
        infos = [
            RowSamplingInfo(
                params=r.sampling_params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                generator=self._generator_for(r),
                eos_token_ids=r.eos_token_ids,
            )
            for r in row_states
        ]
        return SamplingMetadata.build(infos, self.device, logits.shape[-1])

    def _prompt_logprobs(
        self,
        requests: list[RequestState],
        num_computed_tokens: list[int],
        num_scheduled_tokens: list[int],
        batch: HostBatch,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        for i, r in enumerate(requests):
            k = r.sampling_params.prompt_logprobs
            start = num_computed_tokens[i]
            if k is None or start >= r.num_prompt_tokens:
                continue
            end = min(start + num_scheduled_tokens[i], r.num_prompt_tokens)
            # The logits at prompt position p score prompt token p + 1.
            last_scored = min(end, r.num_prompt_tokens - 1)
            entries: list[TokenLogprobs | None] = [None] if start == 0 else []
            if last_scored > start:
                row0 = int(batch.query_start_loc[i])
                logits = self.model.compute_logits(hidden[row0 : row0 + last_scored - start])
                targets = torch.tensor(r.prompt_token_ids[start + 1 : last_scored + 1], device=self.device)
                token_lp, rank, top_ids, top_lps = compute_token_logprobs(logits, targets, k)
                token_lp, rank = token_lp.tolist(), rank.tolist()
                top_ids, top_lps = top_ids.tolist(), top_lps.tolist()
                for j, target in enumerate(targets.tolist()):
                    entries.append(
                        TokenLogprobs(
                            token_ids=[target, *top_ids[j]], logprobs=[token_lp[j], *top_lps[j]], rank=rank[j]
                        )
                    )
            output.prompt_logprobs[r.request_id] = entries
