"""The engine's options, declared once: `EngineArgs`.

Each field is one option with its default and its help text. From the dataclass come the CLI flags
(`add_cli_args`), the `LLM(...)` keyword arguments (`from_kwargs`), `--config FILE.yaml` (through
the flags, see arg_parser.py) and the frozen `EngineConfig` (`create_engine_config`), which checks
the values, resolves what depends on the device and logs the result once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tokenmill import envs
from tokenmill.arg_parser import add_config_file_arg, close_names, parse_bytes
from tokenmill.config import (
    QUANTIZATION_METHODS,
    CacheConfig,
    EngineConfig,
    KernelConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SloConfig,
)
from tokenmill.slo import check_target_ms, parse_slo_classes

logger = logging.getLogger(__name__)

# A step's token budget bounds how long one step can hold every running request. On the CPU a
# prefill runs at a few hundred tokens/s on the engine's one thread (SmolLM2-135M: ~310 tok/s), so
# 2048 tokens meant steps of ~6 s during which no stream moved, and a burst of 8 prompts got
# their first tokens together after all 8 prefills. 512 keeps a step near 1.6 s; in the serve
# A/B of BENCHMARKS.md it halved the mean TTFT at the same output rate.
DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU = 512
DEFAULT_MAX_NUM_BATCHED_TOKENS_GPU = 8192
# While requests decode, a CPU step's prefill chunks take at most this many tokens, and fewer where
# --prefill-step-target-ms predicts a longer step (never below the scheduler's
# MIN_PREFILL_TOKENS_WHILE_DECODING, 32). Every prefill token in a step delays every decoding
# stream's next token: 512-token chunks made 1.0-1.5 s steps, the c=32 serve benchmark's ITL p99.
# A fixed 32 (the default until 2026-12-03) spread a joining prompt over ~4 steps; each step reads
# all the weights once, so on the 2-core AVX2 machine, with the 16-bit integer kernels and the helper
# thread (~2 ms a prompt token, ~2.5 ms a decoding row, ~12 ms a step), 128 trimmed by the target
# served c=32 faster at ITL p99 < 0.5 s (docs/CPU_PERFORMANCE.md). A closed loop of equal prompt and
# answer lengths must prefill about one token per decoding stream a step (~31 at c=32), whatever the
# cap; below that the queue of prompts grows without end (16 at c=32: TTFT p50 18 s). 0 on a GPU.
DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING_CPU = 128
# --prefill-step-target-ms on the CPU: a step that is still prefilling adds no further prompt once
# its predicted time passes this: prompts that arrive together are prefilled about one a step
# (a single prompt is never split by it; a 128-token prompt's step is ~0.27 s on the 2-core AVX2
# machine); short prompts still share a step. While requests decode it trims the cap above: 350 ms
# leaves the whole 128 beside ~31 decodes there (~0.35 s) and shrinks the chunks on slower machines.
# 250 (the default until 2026-12-03) cut them to ~80 tokens there, and c=32's TTFT p50 rose to
# 1.5-1.8 s (prompts that arrive at one a step while the loop prefills less than one a step queue up).
# 0 on a GPU and offline.
DEFAULT_PREFILL_STEP_TARGET_MS_CPU = 350.0

SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "float", "bf16", "fp16", "half")
LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")  # e4m3 of value / scale, scales per layer (and KV head)
REFUSED_KV_CACHE_DTYPES = ("fp8_e5m2",)  # parsed so the error can say what to use instead

# KernelConfig fields with an option of their own; --kernel-config sets the others.
_KERNEL_FIELDS_WITH_OWN_OPTION = ("cpu_weight_packing", "cpu_quantized_gemv")
# The environment variables that set a KernelConfig field's default (benchmark A/B scripts use them).
_KERNEL_ENV_DEFAULTS: dict[str, envs.EnvVar[bool | None]] = {
    "row_gemv": envs.TOKENMILL_ROW_GEMV,
    "skinny_gemm": envs.TOKENMILL_SKINNY_GEMM,
    "fused_decode_rope": envs.TOKENMILL_FUSED_DECODE_ROPE,
    "deferred_norm": envs.TOKENMILL_DEFERRED_NORM,
    "fused_decode_layers": envs.TOKENMILL_FUSED_DECODE_LAYERS,
}


def resolve_otlp_traces_endpoint(flag: str | None) -> str | None:
    """--otlp-traces-endpoint, else the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; checked to be an
    http(s) URL (the exporter speaks OTLP over HTTP/protobuf)."""
    url = flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None
    if url is not None and not re.match(r"^https?://[^/\s]+", url):
        raise ValueError(
            f"otlp_traces_endpoint must be an http(s) URL of an OTLP/HTTP collector such as "
            f"http://localhost:4318/v1/traces, got {url!r}"
        )
    return url


def _option(
    default: Any, help: str, *, choices: tuple[str, ...] | None = None, parse: Any = None, several: bool = False
) -> Any:
    """A field of EngineArgs: its default, its help text, and for the CLI its choices / value parser;
    `several`: a string option whose flag takes one or more values, kept comma-joined."""
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse, "several": several})


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object such as '{{\"row_gemv\": false}}', got {text!r}"
        )
    return value


@dataclass(slots=True)
class EngineArgs:
    """Every engine option. `LLM(model, **kwargs)` and the CLI flags (`--max-num-seqs` for
    `max_num_seqs`) are these fields; `create_engine_config()` turns them into an EngineConfig."""

    model: str | None = _option(
        None,
        "HF model directory, .gguf file, or Hugging Face Hub id ORG/NAME (ORG/NAME/FILE.gguf: one GGUF file "
        "of a repository), fetched into the Hub's cache; a local path that exists wins "
        "(default: SmolLM2-135M-Instruct)",
    )
    revision: str | None = _option(None, "Hub ids: the branch, tag or commit to load (default: main)")
    download_dir: str | None = _option(
        None,
        "Hub ids: the cache directory to fetch into and look in (default: the Hugging Face cache, "
        "$HF_HUB_CACHE or $HF_HOME/hub, shared with other Hugging Face tools); HF_TOKEN gives gated "
        "and private repositories, HF_HUB_OFFLINE=1 uses only the cache",
    )
    tokenizer: str | None = _option(None, "tokenizer directory, .gguf file or Hub id (default: the model's)")
    tokenizer_revision: str | None = _option(None, "a Hub tokenizer's branch, tag or commit (default: main)")
    served_model_name: str | None = _option(
        None,
        "name(s) the model is served as, space- or comma-separated; the first is its own (default: the model)",
        several=True,
    )
    max_model_len: int | None = _option(None, "longest sequence, prompt and output (default: the model's)")
    max_num_seqs: int = _option(256, "most sequences running in one step")
    max_num_batched_tokens: int | None = _option(
        None,
        "tokens per scheduler step, prefill chunks and decodes together "
        f"(default: {DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU} on the CPU, "
        f"{DEFAULT_MAX_NUM_BATCHED_TOKENS_GPU} on a GPU)",
    )
    max_prefill_tokens_while_decoding: int | None = _option(
        None,
        "while any request decodes, the most prompt tokens one step prefills (bounds the inter-token "
        f"gap a prefill adds); 0: only max_num_batched_tokens (default: {DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING_CPU} "
        "on the CPU, 0 on a GPU and in the offline LLM / bench throughput)",
    )
    prefill_step_target_ms: float | None = _option(
        None,
        "a step's prefill stops where the step cost learned from the engine's own steps predicts "
        "the step would take longer than this many ms: while nothing decodes, after its first prompt "
        "chunk (never below max_prefill_tokens_while_decoding), so prompts that arrive together "
        "finish prefill one after another, not all in one long step; while requests decode, below "
        "max_prefill_tokens_while_decoding down to 32 tokens a step (or the cap, if smaller); 0: off "
        f"(default: {DEFAULT_PREFILL_STEP_TARGET_MS_CPU:g} on the CPU, 0 on a GPU and in the offline LLM / bench throughput)",
    )
    num_kv_blocks: int | None = _option(None, "KV pool size in blocks (overrides sizing)")
    kv_cache_memory: int | None = _option(None, "CPU: KV pool size in bytes, e.g. 2GiB", parse=parse_bytes)
    gpu_memory_utilization: float = _option(0.9, "GPU: fraction of the GPU's memory the engine may use")
    enable_prefix_caching: bool = _option(True, "reuse the KV blocks of prompts' shared prefixes")
    kv_offload_gb: float = _option(
        0.0,
        "GiB of host memory for KV blocks evicted from the device prefix cache, copied back on a later "
        "prefix hit instead of recomputed (pinned on CUDA); 0: off. Needs prefix caching and a model "
        "without sliding-window layers",
    )
    kv_role: str | None = _option(
        None,
        "disaggregated prefill/decode: producer sends the prompt KV blocks of its finished requests to "
        "the consumer at --kv-transfer-address, which starts the same prompts from them (docs/KV_OFFLOAD.md)",
        choices=("producer", "consumer"),
    )
    kv_transfer_address: str | None = _option(
        None, "ZMQ address the consumer binds and the producer connects to, e.g. tcp://127.0.0.1:5590 or ipc:///tmp/kv"
    )
    kv_claim_timeout: float = _option(30.0, "consumer: seconds a received block waits for its request")
    kv_transfer_buffer_gb: float = _option(2.0, "consumer: GiB of received blocks kept unclaimed at most")
    kv_transfer_wait: float = _option(
        5.0, "consumer: seconds a request naming a transfer id (kv_transfer_params) waits for the producer's "
        "blocks before it computes its prompt itself",
    )  # fmt: skip
    block_size: int = _option(16, "tokens per KV cache block")
    kv_cache_dtype: str = _option(
        "auto",
        "KV cache element type; auto: the model's dtype; fp8 (= fp8_e4m3): half a 16-bit cache's bytes, "
        "values stored as e4m3 of value / scale with the checkpoint's k_scale / v_scale (else 1.0)",
        choices=KV_CACHE_DTYPES + FP8_KV_CACHE_DTYPES + REFUSED_KV_CACHE_DTYPES,
    )
    load_format: str = _option(
        "auto",
        "weights format; auto: safetensors, else pytorch_model*.bin (pt, read with "
        "torch.load(weights_only=True): tensors only), else GGUF; dummy: random weights at the model's shapes",
        choices=LOAD_FORMATS,
    )
    dtype: str = _option(
        "auto", "weights and activations; auto: float32 on the CPU, bfloat16 on a GPU", choices=DTYPES
    )
    quantization: str | None = _option(
        None,
        "quantized linear layers: a quantized checkpoint's method is read from its config (this must "
        "then name the same one or stay unset); on a 16-bit checkpoint, GGUF or dummy weights: fp8 = "
        "FP8 W8A8 with per-channel scales, awq / gptq = 4-bit groups of 128 (round to nearest), "
        "quantized at load",
        choices=QUANTIZATION_METHODS,
    )
    seed: int = _option(0, "random seed of the weights (dummy) and of sampling without a request seed")
    device: str = _option("auto", "auto | cpu | cuda | cuda:N (auto: cuda when available)")
    enforce_eager: bool = _option(False, "GPU: no CUDA graphs")
    async_scheduling: bool | None = _option(
        None, "prepare and launch the next step while the device runs this one (default: on for CUDA)"
    )
    trace_dir: str | None = _option(
        None,
        "write per-request timelines (requests.jsonl: arrival, queued, each prefill chunk, first token) "
        "and per-step records (steps.jsonl: tokens, batch shape, host and device time, JIT compiles, GC "
        "pauses) to this directory; `bench serve --server-trace-dir` reads them",
    )
    otlp_traces_endpoint: str | None = _option(
        None,
        "`serve`: export one OpenTelemetry span per request (stages as events, the caller's W3C "
        "traceparent as parent) to this OTLP/HTTP traces URL, e.g. http://localhost:4318/v1/traces "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset: no tracing); needs tokenmill[otel]",
    )
    speculative_config: dict[str, Any] | None = _option(
        None,
        "speculative decoding, vLLM's JSON: {\"method\": \"ngram\" | \"draft_model\" | \"eagle3\", "
        "\"num_speculative_tokens\": k, \"model\": drafter (draft_model, eagle3), \"prompt_lookup_min\" / "
        "\"prompt_lookup_max\" (ngram), \"disable_by_batch_size\": no drafts above this many running "
        "requests}; greedy output is unchanged, sampled output keeps the model's distribution",
        parse=_json_object,
    )
    enable_lora: bool = _option(
        False,
        "serve LoRA adapters (PEFT format) beside the base model; requests pick one by name "
        "(--lora-modules, /v1/load_lora_adapter) or offline with LLM.generate(lora_request=...)",
    )
    max_loras: int = _option(1, "LoRA: adapters on the device at once (one step serves at most this many)")
    max_lora_rank: int = _option(16, "LoRA: the largest adapter rank accepted (device slots are this wide)")
    max_cpu_loras: int | None = _option(
        None, "LoRA: adapters kept loaded in host memory, least recently used evicted (default: --max-loras)"
    )
    tensor_parallel_size: int = _option(
        1,
        "split the model over this many worker processes (tensor parallelism: heads, MLP columns and "
        "the vocabulary sharded; one all-reduce after attention and one after the MLP); the query heads "
        "must divide by it, and the KV heads divide by it or it by them (docs/DISTRIBUTED.md)",
    )
    distributed_executor_backend: str | None = _option(
        None,
        "how tensor-parallel workers run: mp = one local process per rank, ray = Ray actors in a "
        "placement group on a Ray cluster (ray.init(address='auto'), else a local one) "
        "(default: mp when tensor_parallel_size > 1)",
        choices=("mp", "ray"),
    )
    enable_custom_all_reduce: bool = _option(
        False,
        "tensor parallelism on GPUs: all-reduces of up to 1 MiB (the decode steps') through a one-shot "
        "kernel over symmetric memory instead of NCCL; 2.8x faster per call in isolation on 2 x H200, "
        "no faster in a TP=2 decode step so far, hence off by default (docs/DISTRIBUTED.md)",
    )
    scheduling_policy: str = _option(
        "fcfs", "fcfs: first come first served; priority: by each request's priority; slo: least slack "
        "to its latency targets first, shedding (429) requests that can no longer meet them "
        "(docs/SLO_SCHEDULING.md)",
        choices=SCHEDULING_POLICIES,
    )  # fmt: skip
    slo_ttft_ms: float | None = _option(
        None, "--scheduling-policy slo: the time-to-first-token target (ms) of requests that set none"
    )
    slo_tpot_ms: float | None = _option(
        None, "--scheduling-policy slo: the time-per-output-token target (ms) of requests that set none"
    )
    slo_class: str | None = _option(
        None,
        "--scheduling-policy slo: targets by request priority, PRIORITY=TTFT_MS/TPOT_MS each (either may "
        "be empty), e.g. `--slo-class 0=500/50 1=5000/`; a request's own slo_ttft_ms / slo_tpot_ms win",
        several=True,
    )
    attention_backend: str = _option(
        "auto",
        "auto: triton on CUDA, the C++ paged kernels (cpu) on CPU; torch: the reference (gather + SDPA)",
        choices=("auto", "torch", "cpu", "triton"),
    )
    chat_template: str | None = _option(None, "a Jinja chat template, or a file holding one")
    generation_config: str = _option(
        "auto",
        "default sampling parameters of requests that set none: auto: the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens; for the "
        "default model its card's recommendation); vllm: tokenmill's own defaults; or a directory "
        "holding a generation_config.json",
    )
    cpu_weight_packing: bool = _option(
        True, "CPU, float32: prepack matmul weights for oneDNN (faster at batch sizes above 1)"
    )
    cpu_quantized_gemv: bool = _option(
        True,
        "CPU, float32, GGUF models: matmuls of up to 4 rows (a few requests decoding) read the file's "
        "Q4_1 / Q8_0 weights directly instead of their float32 copies (several times fewer bytes)",
    )
    kernel_config: dict[str, Any] | None = _option(
        None,
        "JSON object of kernel-path choices, e.g. '{\"row_gemv\": false}'; keys: "
        + ", ".join(f.name for f in fields(KernelConfig) if f.name not in _KERNEL_FIELDS_WITH_OWN_OPTION)
        + " (defaults: the fastest measured paths, or $TOKENMILL_ROW_GEMV and the like when set)",
        parse=_json_object,
    )

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """`LLM(...)`'s keyword arguments; an unknown one is an error naming it and close valid names."""
        names = [f.name for f in fields(cls)]
        for key in kwargs:
            if key not in names:
                raise TypeError(
                    f"unknown engine option {key!r}{close_names(key, names)} (valid options: {', '.join(names)})"
                )
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field (`--max-num-seqs`), plus `--config FILE.yaml`."""
        group = parser.add_argument_group("engine options")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            base = _base_type(hints[f.name])
            kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
            if base is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = f.metadata["parse"] or base
                if f.metadata["choices"]:
                    kwargs["choices"] = f.metadata["choices"]
                if f.metadata["several"]:
                    kwargs["nargs"] = "+"
            group.add_argument(flag, **kwargs)
        add_config_file_arg(group)

    def as_kwargs(self) -> dict[str, Any]:
        """The `LLM(**kwargs)` that gives these options."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        for f in fields(cls):
            if f.metadata["several"] and isinstance(values[f.name], list):  # `--served-model-name a b`
                values[f.name] = ",".join(values[f.name])
        return cls(**values)

    # -- the config -----------------------------------------------------------------------------

    def create_engine_config(self, *, resolve_device: bool = True) -> EngineConfig:
        """The frozen EngineConfig: values checked, device-dependent defaults resolved, logged once.

        `resolve_device=False` is for the API server process, which must not import torch: the
        device stays as asked ("auto" included) and the defaults that depend on it (step budget,
        async scheduling) stay None; the engine core resolves them (`resolve_device_defaults`) and
        reports them back in its EngineInfo."""
        from tokenmill.chat_template import load_chat_template
        from tokenmill.spec_decode.config import parse_speculative_config

        _check_device_name(self.device)
        self._check()
        names = [n.strip() for n in (self.served_model_name or "").split(",") if n.strip()]
        config = EngineConfig(
            model=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                revision=self.revision,
                tokenizer_revision=self.tokenizer_revision,
                download_dir=self.download_dir,
                dtype=self.dtype,
                quantization=self.quantization,
                load_format=self.load_format,  # type: ignore[arg-type]
                max_model_len=self.max_model_len,
                seed=self.seed,
                chat_template=load_chat_template(self.chat_template),
                served_model_name=names[0] if names else None,
                generation_config=self.generation_config,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_dtype=self.kv_cache_dtype,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_offload_gb=self.kv_offload_gb,
                kv_role=self.kv_role,
                kv_transfer_address=self.kv_transfer_address,
                kv_claim_timeout_s=self.kv_claim_timeout,
                kv_transfer_buffer_gb=self.kv_transfer_buffer_gb,
                kv_transfer_wait_s=self.kv_transfer_wait,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
                prefill_step_target_ms=self.prefill_step_target_ms,
                policy=self.scheduling_policy,  # type: ignore[arg-type]
                slo=self.create_slo_config(),
            ),
            kernel=self.create_kernel_config(),
            device=self.device,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            async_scheduling=self.async_scheduling,
            trace_dir=self.trace_dir,
            otlp_traces_endpoint=resolve_otlp_traces_endpoint(self.otlp_traces_endpoint),
            speculative=parse_speculative_config(self.speculative_config),
            lora=self._lora_config(),
            parallel=self._parallel_config(),
        )
        if resolve_device:
            config = resolve_device_defaults(config)
        self._log(config)
        return config

    def _parallel_config(self) -> ParallelConfig:
        """Refuses, naming the option, what tensor parallelism does not shard yet (docs/DISTRIBUTED.md)."""
        size = self.tensor_parallel_size
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
        if size > 1:
            from tokenmill.spec_decode.config import parse_speculative_config

            speculative = parse_speculative_config(self.speculative_config)
            spec_method = speculative.method if speculative is not None else None
            unsupported = {
                # ngram proposes on the host from tokens every rank holds; a drafter model is unsharded.
                f"speculative_config method {spec_method!r} (--speculative-config)": spec_method not in (None, "ngram"),
                "kv_cache_dtype fp8 (--kv-cache-dtype)": self.kv_cache_dtype in FP8_KV_CACHE_DTYPES,
                # The KV connectors' worker side reads one process's KV pool (docs/KV_OFFLOAD.md).
                "kv_offload_gb (--kv-offload-gb)": bool(self.kv_offload_gb),
                "kv_role (--kv-role)": self.kv_role is not None,
            }
            refused = [name for name, on in unsupported.items() if on]
            if refused:
                raise ValueError(
                    f"tensor_parallel_size={size} does not support {', '.join(refused)} yet; "
                    "turn it off or use tensor_parallel_size=1"
                )
        backend = self.distributed_executor_backend
        if backend is None and size > 1:
            backend = "mp"
        return ParallelConfig(size, backend, custom_all_reduce=self.enable_custom_all_reduce)  # type: ignore[arg-type]

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            for name in ("max_cpu_loras",):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} is set but LoRA is off; add enable_lora (--enable-lora)")
            return None
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras}): every adapter "
                "on the device is also kept in host memory"
            )
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def create_slo_config(self) -> SloConfig:
        """The `slo` policy's targets; setting them under another policy is an error (they would
        be ignored)."""
        given = [
            f"--{name.replace('_', '-')}"
            for name in ("slo_ttft_ms", "slo_tpot_ms", "slo_class")
            if getattr(self, name) is not None
        ]
        if given and self.scheduling_policy != "slo":
            raise ValueError(
                f"{', '.join(given)} only apply with --scheduling-policy slo (this is "
                f"{self.scheduling_policy}); add --scheduling-policy slo or leave them out"
            )
        check_target_ms("--slo-ttft-ms", self.slo_ttft_ms)
        check_target_ms("--slo-tpot-ms", self.slo_tpot_ms)
        classes = parse_slo_classes(self.slo_class) if self.slo_class else ()
        return SloConfig(self.slo_ttft_ms, self.slo_tpot_ms, classes)

    def _check(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 0:
            raise ValueError(
                "max_prefill_tokens_while_decoding must be >= 0 (0: no cap), "
                f"got {self.max_prefill_tokens_while_decoding}"
            )
        if self.prefill_step_target_ms is not None and not self.prefill_step_target_ms >= 0:
            raise ValueError(f"prefill_step_target_ms must be >= 0 (0: off), got {self.prefill_step_target_ms}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        self._check_kv_offload()
        self._check_kv_transfer()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        self.create_slo_config()
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.kv_cache_dtype in REFUSED_KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported (its 2 mantissa bits lose too much "
                f"of K and V); use fp8 (e4m3) or one of {', '.join(KV_CACHE_DTYPES)}"
            )
        _check_generation_config(self.generation_config)
        for f in fields(self):
            choices, value = f.metadata["choices"], getattr(self, f.name)
            if choices and value is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {value!r}")

    def _check_kv_transfer(self) -> None:
        if self.kv_role is None:
            if self.kv_transfer_address is not None:
                raise ValueError("kv_transfer_address is set but kv_role is not; add --kv-role producer|consumer")
            return
        if not self.kv_transfer_address:
            raise ValueError(
                f"kv_role {self.kv_role!r} needs kv_transfer_address (e.g. tcp://127.0.0.1:5590), the address "
                "the consumer binds and the producer connects to"
            )
        if self.kv_offload_gb:
            raise ValueError("kv_role and kv_offload_gb cannot be combined yet (one KV connector per engine)")
        if not self.enable_prefix_caching:
            raise ValueError("kv_role needs prefix caching (blocks travel by their prefix-cache keys)")
        from tokenmill.spec_decode.config import parse_speculative_config

        speculative = parse_speculative_config(self.speculative_config)
        if speculative is not None and speculative.method != "ngram":
            raise ValueError(
                f"kv_role does not support speculative method {speculative.method!r} yet (its draft model's "
                "KV cache is not transferred); use ngram or no speculative decoding"
            )
        for name in ("kv_claim_timeout", "kv_transfer_buffer_gb", "kv_transfer_wait"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

    def _check_kv_offload(self) -> None:
        value = self.kv_offload_gb
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"kv_offload_gb must be a finite number of GiB >= 0 (0: off), got {value!r}")
        if value == 0:
            return
        if not self.enable_prefix_caching:
            raise ValueError(
                "kv_offload_gb needs prefix caching: the host tier holds blocks the prefix cache evicts; "
                "drop --no-enable-prefix-caching or set kv_offload_gb to 0"
            )
        from tokenmill.spec_decode.config import parse_speculative_config

        speculative = parse_speculative_config(self.speculative_config)
        if speculative is not None and speculative.method != "ngram":
            raise ValueError(
                f"kv_offload_gb does not support speculative method {speculative.method!r} yet (its draft "
                "model's KV cache is not offloaded); use ngram or set kv_offload_gb to 0"
            )

    def create_kernel_config(self) -> KernelConfig:
        """KernelConfig: --kernel-config's keys, else $TOKENMILL_ROW_GEMV and the like when set,
        else KernelConfig's defaults; skinny GEMM needs row GEMV's out-major weights, so it is off
        whenever row GEMV is."""
        kernel_fields = {f.name: f for f in fields(KernelConfig)}
        valid = [name for name in kernel_fields if name not in _KERNEL_FIELDS_WITH_OWN_OPTION]
        chosen = dict(self.kernel_config or {})
        for key, value in chosen.items():
            if key in _KERNEL_FIELDS_WITH_OWN_OPTION:
                raise ValueError(
                    f"kernel_config key {key!r} has an option of its own: "
                    f"--{key.replace('_', '-')} / --no-{key.replace('_', '-')} ({key}=...)"
                )
            if key not in kernel_fields:
                raise ValueError(
                    f"unknown kernel_config key {key!r}{close_names(key, valid)} (valid keys: {', '.join(valid)})"
                )
            expected = type(kernel_fields[key].default)
            if type(value) is not expected or (expected is int and value < 0):
                raise ValueError(
                    f"kernel_config {key!r} must be a{' non-negative' if expected is int else ''} "
                    f"{expected.__name__}, got {value!r}"
                )
        values: dict[str, Any] = {}
        for name, var in _KERNEL_ENV_DEFAULTS.items():
            from_env = var.get()
            if from_env is not None:
                values[name] = from_env
        values.update(chosen)
        kernel = KernelConfig(
            **values, cpu_weight_packing=self.cpu_weight_packing, cpu_quantized_gemv=self.cpu_quantized_gemv
        )
        if not kernel.row_gemv and kernel.skinny_gemm:
            kernel = dataclasses.replace(kernel, skinny_gemm=False)
        if kernel.cpu_activation_bits not in (0, 8, 16):
            raise ValueError(
                f"kernel_config 'cpu_activation_bits' must be 0 (float32), 8 or 16, got {kernel.cpu_activation_bits}"
            )
        if kernel.cpu_kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(
                "kernel_config 'cpu_kv_cache_dtype' must be auto, float32, float16 or bfloat16, got "
                f"{kernel.cpu_kv_cache_dtype!r}"
            )
        return kernel

    def non_default_options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    def _log(self, config: EngineConfig) -> None:
        options = ", ".join(f"{name}={_short(value)}" for name, value in self.non_default_options().items())
        if config.async_scheduling is None:  # left to the engine core (the API server has no torch)
            resolved = "device and its defaults resolved by the engine core"
        else:
            resolved = (
                f"resolved: device={config.device}, max_num_batched_tokens="
                f"{config.scheduler.max_num_batched_tokens}, async_scheduling={config.async_scheduling}"
            )
        logger.info(
            "engine options: %s; %s; kernel paths: %s",
            options or "all defaults",
            resolved,
            ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(config.kernel).items()),
        )


def _check_generation_config(value: str) -> None:
    """auto, vllm, or a directory with a generation_config.json: a typo fails at start-up, not
    silently as "no defaults"."""
    if value in ("auto", "vllm"):
        return
    path = Path(value).expanduser()
    if not (path / "generation_config.json").is_file():
        what = "has no generation_config.json" if path.is_dir() else "is not a directory"
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a directory holding a generation_config.json; "
            f"{value!r} {what}"
        )


def _check_device_name(name: str) -> None:
    """The device names resolve_device takes, checked without torch (the API server has none)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", name):
        raise ValueError(f"unknown device {name!r}; expected auto, cpu or cuda[:N]")


def resolve_device_defaults(config: EngineConfig) -> EngineConfig:
    """The config with device "auto" resolved and the defaults that depend on the device filled
    in: the step budget (512 tokens on the CPU, 8192 on a GPU) and async scheduling (on for CUDA,
    where the device runs apart from the host). Idempotent; imports torch, so the engine core
    calls it, not the API server."""
    from tokenmill.device import resolve_device

    device = resolve_device(config.device)
    on_gpu = device.type == "cuda"
    budget = config.scheduler.max_num_batched_tokens
    if budget is None:
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS_GPU if on_gpu else DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU
    prefill_cap = config.scheduler.max_prefill_tokens_while_decoding
    if prefill_cap is None:
        prefill_cap = 0 if on_gpu else DEFAULT_MAX_PREFILL_TOKENS_WHILE_DECODING_CPU
    step_target = config.scheduler.prefill_step_target_ms
    if step_target is None:
        step_target = 0.0 if on_gpu else DEFAULT_PREFILL_STEP_TARGET_MS_CPU
    return dataclasses.replace(
        config,
        device=str(device),
        scheduler=dataclasses.replace(
            config.scheduler,
            max_num_batched_tokens=budget,
            max_prefill_tokens_while_decoding=prefill_cap,
            prefill_step_target_ms=step_target,
        ),
        async_scheduling=config.async_scheduling if config.async_scheduling is not None else on_gpu,
    )


def _base_type(hint: Any) -> type:
    """`int | None` -> int; `dict[str, Any] | None` -> dict."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return typing.get_origin(hint) or hint


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
