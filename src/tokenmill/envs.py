"""Every `TOKENMILL_*` environment variable, in one typed registry.

Each variable is declared once here with its type, default and help, and read through `.get()` at
the moment it is used (never at import), so a test or a benchmark script that sets a variable after
importing tokenmill still takes effect. `tokenmill envs` (or `describe()`) lists them.

An unset or empty variable means its default; a value that does not parse is an error naming the
variable, rather than a silently ignored setting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE + _FALSE)}")


def _parse_str(text: str) -> str:
    return text


@dataclass(frozen=True, slots=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]
    default: T
    help: str
    type_name: str

    def get(self) -> T:
        """The variable's value now: parsed, or the default when unset or empty."""
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(
                f"environment variable {self.name}={raw!r} is not a valid {self.type_name}: {exc}"
            ) from None

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


REGISTRY: dict[str, EnvVar] = {}


def _register(name: str, parse: Callable[[str], T], default: T, help: str, type_name: str) -> EnvVar[T]:
    if not name.startswith("TOKENMILL_") or name in REGISTRY:
        raise ValueError(f"environment variable {name!r} must start with TOKENMILL_ and be declared once")
    var = EnvVar(name, parse, default, help, type_name)
    REGISTRY[name] = var
    return var


def _bool(name: str, default: bool | None, help: str) -> EnvVar[bool | None]:
    return _register(name, parse_bool, default, help, "bool")


def _str(name: str, default: str | None, help: str) -> EnvVar[str | None]:
    return _register(name, _parse_str, default, help, "string")


def _int(name: str, default: int | None, help: str) -> EnvVar[int | None]:
    return _register(name, int, default, help, "int")


def _float(name: str, default: float | None, help: str) -> EnvVar[float | None]:
    return _register(name, float, default, help, "float")


def _parse_positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise ValueError(f"expected a number above 0, got {value}")
    return value


def _positive_float(name: str, default: float, help: str) -> EnvVar[float]:
    return _register(name, _parse_positive_float, default, help, "positive float")


TOKENMILL_CACHE = _str(
    "TOKENMILL_CACHE",
    None,
    "directory for the default model and compiled CPU kernels (unset: ~/.cache/tokenmill)",
)
TOKENMILL_API_KEY = _str(
    "TOKENMILL_API_KEY",
    None,
    "`tokenmill serve`: require 'Authorization: Bearer <key>' when --api-key is not given",
)
TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING = _bool(
    "TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING",
    False,
    "`tokenmill serve`: serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as "
    "--allow-runtime-lora-updating; vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
)
TOKENMILL_LOG_STATS_INTERVAL = _float(
    "TOKENMILL_LOG_STATS_INTERVAL",
    10.0,
    "`tokenmill serve`: seconds between the stats lines (throughput, running / waiting, KV cache, prefix "
    "hits); --disable-log-stats turns them off",
)
TOKENMILL_API_SERVER_RESTARTS = _int(
    "TOKENMILL_API_SERVER_RESTARTS",
    3,
    "`tokenmill serve --api-server-count N`: how many times in 5 minutes an API server process other "
    "than the first is restarted after it dies; one more death stops the server (exit code 1)",
)
TOKENMILL_API_SERVER_STALL_TIMEOUT = _positive_float(
    "TOKENMILL_API_SERVER_STALL_TIMEOUT",
    30.0,
    "`tokenmill serve --api-server-count N`: seconds an API server process other than the first may "
    "leave the engine's messages unread once its socket queue (1,000 messages) is full; then the engine "
    "aborts its requests and the first process kills it (it is restarted). Meanwhile the engine keeps "
    "its messages and serves the others",
)
TOKENMILL_COMMIT = _str(
    "TOKENMILL_COMMIT",
    None,
    "benchmark results: the commit to record, for a copy of the tree without .git (unset: git HEAD)",
)
# The kernel switches, when set, are the defaults of the matching KernelConfig fields (EngineArgs
# reads them when it builds the config), so same-run A/B scripts that set them keep working;
# --kernel-config overrides them. Unset: KernelConfig's own default (on).
TOKENMILL_ROW_GEMV = _bool(
    "TOKENMILL_ROW_GEMV",
    None,
    "default of kernel_config row_gemv: CUDA 16-bit one-row matmuls on the Triton row GEMV "
    "(0: cuBLAS with in-major weights; also turns skinny_gemm off)",
)
TOKENMILL_SKINNY_GEMM = _bool(
    "TOKENMILL_SKINNY_GEMM",
    None,
    "default of kernel_config skinny_gemm: CUDA 16-bit 2-8-row matmuls on the Triton skinny GEMM",
)
TOKENMILL_FUSED_DECODE_ROPE = _bool(
    "TOKENMILL_FUSED_DECODE_ROPE",
    None,
    "default of kernel_config fused_decode_rope: single-request decode rotates q/k inside attention",
)
TOKENMILL_DEFERRED_NORM = _bool(
    "TOKENMILL_DEFERRED_NORM",
    None,
    "default of kernel_config deferred_norm: single-request decode folds RMSNorm into the matmuls",
)
TOKENMILL_FUSED_DECODE_LAYERS = _bool(
    "TOKENMILL_FUSED_DECODE_LAYERS",
    None,
    "default of kernel_config fused_decode_layers: CPU GGUF decode steps run their layers in one C++ call",
)
TOKENMILL_STRUCTURED_OUTPUT_COMPILE_TIMEOUT = _float(
    "TOKENMILL_STRUCTURED_OUTPUT_COMPILE_TIMEOUT",
    10.0,
    "seconds a structured-output grammar (JSON schema, regex, EBNF, ...) may take to compile; a "
    "request whose grammar takes longer ends with an 'invalid structured output' error",
)
TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK = _int(
    "TOKENMILL_STRUCTURED_OUTPUT_FILL_CHUNK",
    0,
    "async scheduling: a constrained step's mask rows go to the fill thread in chunks of this many, "
    "each as soon as its requests' previous tokens are accepted, and all rows of a step's batch of "
    "one-token accepts at once right after it, before the rest of the scheduler's update (0, the "
    "default: all rows after the whole update; not measured on the GPU host yet)",
)
TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS = _int(
    "TOKENMILL_STRUCTURED_OUTPUT_FILL_THREADS",
    None,
    "threads xgrammar fills a constrained step's mask rows on (one batch call a step; unset: half "
    "the CPUs this process may run on, 1 to 8; 1 fills them on the engine's fill thread alone)",
)
TOKENMILL_CPU_HELPER_THREAD = _bool(
    "TOKENMILL_CPU_HELPER_THREAD",
    None,
    "CPU: let one helper thread share the quantized products and attention of a process that runs one "
    "or two torch threads (kernels/cpu/csrc/helper_pool.h; unset: on when the process has one or two torch "
    "threads and the machine two or more cores, as the serving and offline engines on a small machine)",
)
TOKENMILL_FUZZ_EXAMPLES = _int(
    "TOKENMILL_FUZZ_EXAMPLES",
    None,
    "reliability tests: examples per fuzzed endpoint (unset: the test's own default)",
)
TOKENMILL_FUZZ_RANDOM = _bool(
    "TOKENMILL_FUZZ_RANDOM",
    False,
    "reliability tests: draw fresh random examples instead of the derandomized fixed set",
)


def _parse_fast_launch(text: str) -> str:
    value = text.strip().lower()
    if value in _TRUE:
        return "1"
    if value in _FALSE:
        return "0"
    if value == "verify":
        return "verify"
    raise ValueError("expected 1 (on), 0 (off) or verify")


TOKENMILL_TRITON_FAST_LAUNCH = _register(
    "TOKENMILL_TRITON_FAST_LAUNCH",
    _parse_fast_launch,
    "1",
    "CUDA: eager Triton launches (attention between piecewise CUDA-graph pieces, the KV store) reuse "
    "the compiled kernel Triton chose without its per-call dispatch, and a step's layers replay the "
    "first layer's attention launches (0: Triton's own dispatch every time; verify: both, raising if "
    "they disagree)",
    "1, 0 or verify",
)


def describe() -> str:
    """One line per variable: name, type, default and help; `*` marks the ones set now."""
    lines = []
    for var in REGISTRY.values():
        mark = "*" if var.is_set() else " "
        default = "unset" if var.default is None else repr(var.default)
        lines.append(f"{mark} {var.name} ({var.type_name}, default {default}): {var.help}")
    return "\n".join(lines)
