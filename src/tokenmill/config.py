"""Engine configuration: frozen dataclasses built once from user options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# --quantization's choices: the quantization_config methods tokenmill runs
# (model/loader/quant_config.py parses them); here so that the arguments need not import the model.
QUANTIZATION_METHODS: tuple[str, ...] = ("fp8", "awq", "gptq", "compressed-tensors")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    # HF directory, .gguf file, Hugging Face Hub id (ORG/NAME, ORG/NAME/FILE.gguf), or None for the
    # default model. A local path that exists wins over a Hub id.
    model: str | None = None
    tokenizer: str | None = None  # a directory, .gguf file or Hub id; defaults to `model`
    # Hub ids: the branch, tag or commit (None: main). The API server pins them to the commits it
    # resolved before it starts the engine process (resolve.pin_snapshots).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # Hub ids: the cache directory (None: Hugging Face's, HF_HOME)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on GPU)
    # None, or a method of model/loader/quant_config.py QUANTIZATION_METHODS: a quantized
    # checkpoint's own method, or 16-bit weights quantized at load.
    quantization: str | None = None
    # pt: PyTorch pytorch_model*.bin files, read with torch.load(weights_only=True)
    load_format: Literal["auto", "safetensors", "pt", "gguf", "dummy"] = "auto"
    max_model_len: int | None = None  # None: the model's own limit
    seed: int = 0
    chat_template: str | None = None  # a Jinja template (or a path to one) overriding the tokenizer's
    served_model_name: str | None = None
    # Where requests' default sampling parameters come from: "auto" (the model's
    # generation_config.json, or the default model's recommended values), "vllm" (ours only), or
    # a directory holding a generation_config.json. See model/generation_defaults.py.
    generation_config: str = "auto"


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Which kernel paths the engine takes. Every benchmark result and the start-up log record it;
    tests set it instead of patching module globals. Defaults are the fastest measured paths.
    EngineArgs builds it (args.py): --kernel-config keys, else $TOKENMILL_ROW_GEMV and the like when
    set, else these defaults; cpu_weight_packing and cpu_quantized_gemv have flags of their own."""

    # CUDA, 16-bit: one-row matmuls on our Triton row GEMV (weights stay out-major); off = cuBLAS
    # with in-major weights, the engine before that kernel.
    row_gemv: bool = True
    # CUDA, 16-bit: 2-8-row matmuls on our Triton skinny GEMM (needs row_gemv's out-major weights).
    skinny_gemm: bool = True
    # CUDA: steps with prefill chunks (and decode batches above the largest whole-step graph)
    # replay graphs captured between attention calls (worker/piecewise_graphs.py); off = eager.
    piecewise_cuda_graphs: bool = True
    # CUDA: single-request decode steps rotate q/k and store K/V inside the attention launch.
    fused_decode_rope: bool = True
    # CUDA: those steps also fold the RMSNorm weights into the matmuls and skip the norm launches.
    deferred_norm: bool = True
    # CPU, GGUF: a decode step's decoder layers run as one C++ call (model/cpu_decode_plan.py) where
    # the model's layers are the plain path it replicates; off = the Python layer loop (same outputs).
    fused_decode_layers: bool = True
    # CUDA, per-channel FP8 weights: one-row matmuls on the tensor-core W8A16 GEMV too
    # (kernels/triton/fp8_tc_gemv.py: weight tiles to float16 in registers, tl.dot, K split), which
    # serves two-row matmuls by default. Off: on an H200 the CUDA-core GEMV was faster at one row
    # (qkv 8.9 vs 10.5 us; single stream 365 vs 348 tok/s, 2026-12-05).
    fp8_tensor_core_gemv: bool = False
    # CUDA, INT4 weights: the few-row kernel subtracts zero points through sum(x) (int4_kernel.py
    # ZERO_BY_XSUM) instead of per weight. Off until measured on a GPU: local sm_90 SASS 541
    # instead of 619 instructions a pack per warp in the one-row kernel's loop.
    int4_zero_by_xsum: bool = False
    # Triton attention: at run time each KV split gets at least this many tokens (0 = as planned).
    min_kv_tokens_per_split: int = 0
    # CPU, float32: prepack matmul weights for oneDNN; off = plain F.linear.
    cpu_weight_packing: bool = True
    # CPU, bfloat16 / float16 weights (--dtype): products of up to four rows, and the
    # mixture-of-experts experts' products, through the C++ 16-bit GEMV (kernels/cpu/csrc/
    # cpu_gemv16.cpp; AVX-512 or AVX2 + FMA + F16C builds): float32 sums like F.linear's, in another
    # order; off = F.linear (on the 2-core dev machine it read one-row weights from memory at ~12 GB/s
    # against the kernel's ~17; single-stream bf16 decode 1.7-2x with it, BENCHMARKS.md).
    cpu_gemv16: bool = True
    # CPU, float32, GGUF: matmuls of a few rows read the file's Q4_1 / Q8_0 blocks.
    cpu_quantized_gemv: bool = True
    # CPU, AVX-512 or AVX2+FMA, GGUF (with cpu_quantized_gemv): matmuls of more rows than the GEMV
    # serves, up to this many (decode batches), dequantize the blocks once a step into a float32
    # panel (kernels/cpu/csrc/cpu_quant_gemm.cpp) instead of reading the float32 oneDNN weights;
    # 0 = off. Above it prefill chunks use oneDNN, unless cpu_quantized_prefill moves them here.
    cpu_quantized_gemm_rows: int = 64
    # CPU, GGUF (with cpu_quantized_gemm_rows > 0): prefill chunks too go through the batched kernel
    # where its path beats oneDNN's float32 there: the AVX2+FMA path (float32 products of the
    # dequantized weights up to summation order) and, with integer activations (cpu_activation_bits
    # 8 or 16), the 16-bit kernel on AVX-512 VNNI or AVX2 (the few-row kernel's 16-bit numerics; it
    # also takes the decode batches there). AVX-512 without VNNI keeps oneDNN (CPU_PERFORMANCE.md).
    cpu_quantized_prefill: bool = True
    # CPU, AVX-512 VNNI or AVX2, GGUF (with cpu_quantized_gemv): the one-to-four-row matmuls (one row
    # on AVX2) quantize the activations per block of 32 to this many bits and multiply with integer
    # dot products (VNNI dpbusd / dpwssd, or AVX2 maddubs / madd)
    # (kernels/cpu/csrc/cpu_quant_gemv_int8.cpp) instead of dequantizing the weights to float32.
    # 16: error ~float32's, greedy tokens kept; 8: llama.cpp's scheme, a little faster, but it
    # flipped near-tie greedy tokens of the default model within 30 tokens; 0 = the float32 GEMV.
    cpu_activation_bits: int = 16
    # CPU, C++ attention backend (AVX2 / AVX-512 builds), float32 model, kv_cache_dtype "auto": the
    # KV cache's element type. float16 halves the bytes a decode step's attention reads from memory
    # (a 64-row step's cache is far beyond L2) and doubles the tokens the pool holds; the kernel
    # converts rows to float32 as it reads them, q, scores, softmax and outputs stay float32, and
    # prefill chunks' reference path reads the same rows. Rounding K and V to float16 (relative
    # error <= 2^-11) kept the default model's greedy tokens in the tests, but moves the float32
    # path's logprobs by up to 1.9e-3 against transformers (1e-4 in float32), i.e. it is lossy like
    # --kv-cache-dtype float16. "auto" = float16 under a GGUF checkpoint (its weights are quantized
    # blocks and its activations 16-bit integers already; llama.cpp's default cache is float16 too),
    # float32 otherwise (the transformers oracle's path); "float32", "float16", "bfloat16" (coarser)
    # choose.
    cpu_kv_cache_dtype: str = "auto"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    block_size: int = 16
    # auto = the model's dtype; the KV store and attention kernels read it from the cache tensors.
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # override the pool size in blocks
    kv_cache_memory: int | None = None  # CPU: pool size in bytes
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Host-memory KV tier (core/host_kv_tier.py): GiB of host memory for blocks evicted from the
    # device prefix cache; 0: off.
    kv_offload_gb: float = 0.0
    # Disaggregated prefill / decode (core/kv_transfer.py): "producer" sends the prompt blocks of
    # finished requests to the consumer at kv_transfer_address (ZMQ), which loads them; None: off.
    kv_role: str | None = None
    kv_transfer_address: str | None = None
    kv_claim_timeout_s: float = 30.0  # consumer: received blocks no request claims are dropped after this
    kv_transfer_buffer_gb: float = 2.0  # consumer: most unclaimed received bytes kept (oldest dropped)
    # consumer: a request naming a transfer id (kv_transfer_params) waits this long for it to arrive
    kv_transfer_wait_s: float = 5.0


@dataclass(frozen=True, slots=True)
class SloConfig:
    """Latency targets for the `slo` scheduling policy (docs/SLO_SCHEDULING.md).

    A request's targets: its own `slo_ttft_ms` / `slo_tpot_ms`, else its priority's class, else
    these defaults; None: no target of that kind."""

    ttft_ms: float | None = None  # time to first token
    tpot_ms: float | None = None  # mean time per output token after the first
    # (priority, ttft_ms, tpot_ms) per class; a None target falls back to the defaults above.
    classes: tuple[tuple[int, float | None, float | None], ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # None until args.resolve_device_defaults fills in the device's default (the engine core does).
    max_num_batched_tokens: int | None = 2048
    policy: Literal["fcfs", "priority", "slo"] = "fcfs"
    max_model_len: int = 2048  # resolved against the model before the scheduler is built
    slo: SloConfig = field(default_factory=SloConfig)
    # While any running request is decoding, the step's prefill chunks (partial prefills, admitted
    # prompts, recomputes after preemption) get at most this many tokens together, so one step
    # never holds every stream for a whole max_num_batched_tokens prefill (on the CPU a 512-token
    # chunk costs ~0.9 s, every decode's inter-token gap). 0: no cap beyond the step budget;
    # None until args.resolve_device_defaults fills in the device's default (the engine core does).
    max_prefill_tokens_while_decoding: int | None = None
    # A step's prefill beyond its first chunk stops where the step-cost model (learned from the
    # engine's own steps) predicts the step would take longer than this, though never below
    # max_prefill_tokens_while_decoding: prompts that arrive together then finish their prefills
    # in different steps, so the first of them answers sooner and, with equal lengths, their
    # answers do not all end in the same step (in the c=32 benchmark's closed loop a clump of
    # prompts finishing prefill together comes back as a clump of new prompts and leaves a queue
    # that does not drain; docs/CPU_PERFORMANCE.md). While requests decode under the CPU's cap it
    # changes nothing. 0: off; None until args.resolve_device_defaults fills in the device's default.
    prefill_step_target_ms: float | None = None


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`, vLLM's keys; spec_decode/config.py parses it).

    A proposer guesses up to `num_speculative_tokens` next tokens per request; the target model
    verifies them all in one step and keeps the ones its own sampling agrees with, plus one more.
    """

    method: Literal["ngram", "draft_model", "eagle3"]
    num_speculative_tokens: int
    model: str | None = None  # draft_model / eagle3: the drafter (a directory or Hub id)
    revision: str | None = None
    # ngram: the longest suffix of the request's tokens of length max..min that occurred before
    # proposes the tokens that followed it.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # No drafts in a step with more running requests than this (verification then costs more
    # than it saves); None: tokenmill's measured default for the device.
    disable_by_batch_size: int | None = None
    # A request whose recent drafts were accepted less than this fraction of the time gets fewer
    # drafts (down to none, then probes again now and then).
    min_acceptance_rate: float = 0.3


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Multi-LoRA (`--enable-lora`): adapters served beside the base model in the same batches.

    `max_loras` adapters fit on the device at once (one step serves at most that many);
    `max_cpu_loras` stay loaded in host memory (least recently used evicted), the rest are read
    from disk again when a request needs them."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    @property
    def host_cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Tensor parallelism (`--tensor-parallel-size`): every linear layer, the embedding and the KV
    heads split over this many worker processes (docs/DISTRIBUTED.md)."""

    tensor_parallel_size: int = 1
    # How the workers run: mp = one local process per rank; ray = Ray actors in a placement group
    # (a cluster's nodes). None: mp when tensor_parallel_size > 1.
    distributed_executor_backend: Literal["mp", "ray"] | None = None
    # Small all-reduces on CUDA through the one-shot symmetric-memory kernel instead of NCCL
    # (distributed/symm_mem_all_reduce.py; --enable-custom-all-reduce). Off by default: faster per
    # call in isolation, no faster in a measured TP=2 decode step (BENCHMARKS.md, issue 22).
    custom_all_reduce: bool = False


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    device: str = "auto"  # auto | cpu | cuda
    enforce_eager: bool = False  # GPU: no CUDA graphs
    attention_backend: str = "auto"  # auto | torch | cpu | triton
    # Schedule and launch step N+1 while step N still runs on the device; None: on for CUDA.
    async_scheduling: bool | None = None
    # A directory: the engine core writes per-step records (steps.jsonl) and the API server
    # per-request timelines (requests.jsonl) there; engine/step_trace.py. None: no tracing.
    trace_dir: str | None = None
    # An OTLP/HTTP collector's traces URL: the engine keeps each request's timeline and the API
    # server exports one span per request there (engine/otel_spans.py). None: no OpenTelemetry.
    otlp_traces_endpoint: str | None = None
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA off
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
