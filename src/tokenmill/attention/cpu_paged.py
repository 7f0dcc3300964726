"""The CPU attention backend: C++ kernels that read the paged KV cache in place.

The torch reference backend gathers every request's context into a contiguous buffer before
its SDPA call; on a decode step that copy moves about as many bytes as the model's weights.
Here one C++ kernel (kernels/cpu/csrc/cpu_paged_attention.cpp) walks each request's block table
instead, and another writes the step's K/V into their slots.

For long query chunks (prefills) over long contexts the gather is paid once for many query rows
and torch's SDPA kernel is faster than our loops, so those requests go to the reference
backend's path over the same cache; the rest of a mixed batch (decodes) stays on the kernel.
Where every long chunk's context is short (up to _MAX_KERNEL_PREFILL_CONTEXT tokens: prompts of
a few hundred tokens, the CPU's 512-token step budget) the kernel takes those chunks too: on
the 2-core EPYC 16 prompts of 128 tokens prefilled in 0.91x / 0.84x the time over a float16 /
float32 cache, 4 of 512 in 0.94x; 2 of 1,800 (later chunks over up to 1,800 keys) took 1.13x.

Both honour each layer's sliding window, soft cap and sinks; a sliding layer never reads the
blocks wholly before the window of a request's earliest query row.
"""

from __future__ import annotations

import torch

from tokenmill.attention.backend import (
    PLAIN_ATTENTION,
    AttentionBackend,
    AttentionLayerSpec,
    AttentionMetadata,
)
from tokenmill.attention.torch_ref import TorchReferenceBackend
from tokenmill.config import KernelConfig
from tokenmill.kernels.cpu.build import load_cpu_kernels

# Requests whose query chunk is longer than this use the reference (gather + SDPA) path...
_MAX_KERNEL_QUERY_LEN = 16
# ... unless every such chunk of the step has at most this many tokens of context (see above).
_MAX_KERNEL_PREFILL_CONTEXT = 512


class CpuPagedBackend(AttentionBackend):
    name = "cpu"
    supported_layer_features = frozenset({"sliding window", "logit soft-capping", "attention sinks"})

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
        *,
        kernel: KernelConfig | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size, kernel=kernel)
        load_cpu_kernels()
        self._reference = TorchReferenceBackend(num_heads, num_kv_heads, head_dim, scale, block_size)
        self.max_kernel_query_len = _MAX_KERNEL_QUERY_LEN
        self.max_kernel_prefill_context = _MAX_KERNEL_PREFILL_CONTEXT
        ops = torch.ops.tokenmill_cpu
        # Resolved overloads: a call skips the op packet's overload lookup (~2 us; two calls a layer).
        self._paged_attention = ops.paged_attention.default
        self._store_kv = ops.store_kv.default
        # The kernel's int32 views of the last step's metadata (starts, seq_lens, block tables) and
        # its int64 slots: converted once a step, not once a layer. Keyed by the metadata object,
        # which the model runner builds anew every step (the reference keeps it alive, so a later
        # step's metadata can never be mistaken for it).
        self._step_meta: AttentionMetadata | None = None
        self._step_tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def auto_kv_cache_dtype(self, model_dtype: torch.dtype, *, quantized_weights: bool = False) -> torch.dtype:
        # A float32 model's cache in 16 bits (KernelConfig.cpu_kv_cache_dtype) where the kernel's
        # decode path converts rows as it reads them (AVX2 / AVX-512 builds: F16C); elsewhere the
        # general path would convert element by element, slower than reading float32. Its "auto":
        # float16 under quantized (GGUF) weights, as llama.cpp's default cache; float32 otherwise,
        # where the float32 path is the transformers oracle's.
        wanted = self.kernel.cpu_kv_cache_dtype
        if wanted == "auto":
            wanted = "float16" if quantized_weights else "float32"
        if model_dtype != torch.float32 or not _vector_build():
            return model_dtype
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[wanted]

    def kernel_tensors(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(starts, seq_lens, block_tables) as the kernel reads them, and the slot mapping (int64)."""
        if meta is not self._step_meta or self._step_tensors is None:
            seq_lens = _int32(meta.seq_lens_cpu)
            self._step_tensors = (
                _int32(meta.query_start_loc_cpu),
                seq_lens,
                _int32(meta.block_tables[: seq_lens.numel()]),
                meta.slot_mapping.to(torch.int64).contiguous(),
            )
            self._step_meta = meta
        return self._step_tensors

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        kv_already_stored: bool = False,
        layer: AttentionLayerSpec = PLAIN_ATTENTION,
    ) -> torch.Tensor:
        if q.device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on CPU tensors, got {q.device}")
        num_tokens = meta.num_actual_tokens
        starts_32, seq_lens_32, tables_32, slots = self.kernel_tensors(meta)
        if not kv_already_stored and num_tokens:
            # The kernel stores the first min(len(slots), len(k)) rows and converts float32 rows
            # into a 16-bit float cache itself: slicing and converting here cost two aten calls
            # a tensor a layer (~0.5 ms of a 10.6 ms one-row step), so only where needed.
            self._store_kv(
                kv_cache,
                _storable(k if k.shape[0] == num_tokens else k[:num_tokens], kv_cache.dtype),
                _storable(v if v.shape[0] == num_tokens else v[:num_tokens], kv_cache.dtype),
                slots if slots.shape[0] == num_tokens else slots[:num_tokens],
            )
        # A float32 model over a 16-bit cache keeps q and the output in float32: the kernel converts
        # the cache's rows as it reads them (half the bytes of a float32 cache), q is not rounded.
        q_dtype = q.dtype if _reads_as_float32(q.dtype, kv_cache.dtype) else kv_cache.dtype
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q_dtype)
        if num_tokens < q.shape[0]:
            out[num_tokens:].zero_()  # padding rows: defined, never read
        # The host copies describe the real requests (a padded batch has empty ones after them).
        starts, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        if num_tokens == 0 or seq_lens.numel() == 0:
            return out if out.dtype == q.dtype else out.to(q.dtype)
        long_reqs = None
        kernel_query_len = self.max_kernel_query_len
        if meta.max_query_len > self.max_kernel_query_len:
            query_lens = starts[1:] - starts[:-1]
            is_long = query_lens > self.max_kernel_query_len
            if bool((seq_lens[is_long] <= self.max_kernel_prefill_context).all()):
                kernel_query_len = int(meta.max_query_len)  # short contexts: all on the kernel
            else:
                long_reqs = torch.nonzero(is_long).flatten()
                if long_reqs.numel() == seq_lens.numel():  # all prefill chunks: the reference path alone
                    return self._reference.forward(q, k, v, kv_cache, meta, kv_already_stored=True, layer=layer)
        # The kernel takes the short queries (decodes, small chunks); the reference the long ones.
        self._paged_attention(
            out,
            q if q.dtype == q_dtype else q.to(q_dtype),
            kv_cache,
            starts_32,
            seq_lens_32,
            tables_32,
            self.scale,
            kernel_query_len,
            layer.sliding_window or 0,
            layer.logits_soft_cap or 0.0,
            None if layer.sinks is None else layer.sinks.to(torch.float32).contiguous(),
        )
        if long_reqs is not None:
            for rows, where in self._reference.attend_requests(q, kv_cache, meta, long_reqs, layer):
                out.index_copy_(0, where, rows.to(out.dtype))
        return out if out.dtype == q.dtype else out.to(q.dtype)

    @staticmethod
    def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """Write k/v rows at `slots` (int64, -1 = nowhere)."""
        torch.ops.tokenmill_cpu.store_kv(
            kv_cache, _storable(k, kv_cache.dtype), _storable(v, kv_cache.dtype), slots.to(torch.int64).contiguous()
        )


def _vector_build() -> bool:
    """Whether the kernels were built with AVX2 (and so F16C) or AVX-512 (-march=native)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _reads_as_float32(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the kernel takes float32 q / out over this cache (a 16-bit float cache)."""
    return q_dtype == torch.float32 and cache_dtype in (torch.float16, torch.bfloat16)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


def _storable(t: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """k or v rows as store_kv takes them: the cache's dtype, or float32 over a 16-bit float cache
    (the kernel converts those), each token's row contiguous."""
    if t.dtype != cache_dtype and not _reads_as_float32(t.dtype, cache_dtype):
        t = t.to(cache_dtype)
    return _rows_contiguous(t)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernel copies each token's [num_kv_heads, head_dim] row as one block of memory.
    if t.stride(2) == 1 and t.stride(1) == t.shape[2]:
        return t
    return t.contiguous()
