"""Reading and checking a PEFT LoRA adapter directory without loading its tensors (and without torch).

A PEFT adapter is `adapter_config.json` (r, lora_alpha, use_rslora, target_modules, ...) and
`adapter_model.safetensors` with, per adapted module, `<prefix>.layers.<i>.<block>.<module>.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r]. `read_adapter` checks the config and every tensor's name and
shape against the base model's shapes (safetensors headers only), so the API server can answer 400
before the engine spends time on it, and the engine's loader (worker/lora/adapter_weights.py) reads
exactly the tensors this listed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# The HF module names a LoRA may adapt, as Llama-style checkpoints name them; Phi-3 fuses q/k/v and
# gate/up into one module each.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
SUPPORTED_MODULES = ATTENTION_MODULES + MLP_MODULES
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")


class BaseShapes(Protocol):
    """What the checks read of the base model (model/arch.py's ArchConfig has it; lora/ sits below
    model/ in the layering, beside the scheduler that carries LoRARequest)."""

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class AdapterError(ValueError):
    """An adapter that cannot be served on this base model; the message says why."""


@dataclass(frozen=True, slots=True)
class ModuleAdapter:
    """One adapted module of one layer: its tensors' names in the file, rank and scale."""

    layer: int
    module: str  # HF module name, e.g. q_proj
    a_name: str
    b_name: str
    rank: int
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r)); the loader folds it into B

    @property
    def hf_weight_name(self) -> str:
        """The base checkpoint's weight this module adapts (the model's linear_for_weight key)."""
        block = "self_attn" if self.module in ATTENTION_MODULES else "mlp"
        return f"model.layers.{self.layer}.{block}.{self.module}.weight"


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    path: Path
    rank: int  # the largest module rank
    modules: tuple[ModuleAdapter, ...]
    weights_file: Path
    base_model_name: str | None

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(sorted({m.module for m in self.modules}))


def module_shapes(arch: BaseShapes) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each adaptable module of `arch` (unsharded)."""
    q = arch.num_heads * arch.head_dim
    kv = arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    shapes = {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "qkv_proj": (q + 2 * kv, hidden),
    }
    if arch.architecture not in _MOE_FAMILIES:
        shapes |= {
            "gate_proj": (inter, hidden),
            "up_proj": (inter, hidden),
            "down_proj": (hidden, inter),
            "gate_up_proj": (2 * inter, hidden),
        }
    return shapes


def read_adapter(path: str | Path, arch: BaseShapes, max_rank: int) -> AdapterSpec:
    """The adapter at `path`, checked against `arch` and `max_rank`; AdapterError naming the problem."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"LoRA adapter path {str(directory)!r} is not a directory")
    config = _read_config(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        found = sorted(p.name for p in directory.iterdir())
        raise AdapterError(
            f"{directory} has no {WEIGHTS_FILE} (found: {', '.join(found) or 'nothing'}); tokenmill loads "
            "PEFT adapters saved as safetensors (save_pretrained's default)"
        )
    shapes = _tensor_shapes(weights)
    base_rank = _positive_int(config, "r")
    alpha = float(config.get("lora_alpha", base_rank))
    rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    modules = _pair_tensors(shapes, weights, arch, base_rank, bool(rank_pattern), alpha, rslora)
    rank = max(m.rank for m in modules)
    if rank > max_rank:
        raise AdapterError(
            f"the adapter at {directory} has rank {rank}, more than --max-lora-rank {max_rank}; "
            f"start the server with --max-lora-rank {rank} or more"
        )
    return AdapterSpec(directory, rank, modules, weights, config.get("base_model_name_or_path"))


def _read_config(directory: Path) -> dict[str, Any]:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise AdapterError(f"{directory} has no {CONFIG_FILE}; a PEFT LoRA adapter directory has one")
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{file} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{file}: peft_type {peft_type} is not supported; tokenmill serves LORA adapters")
    refused = {
        "use_dora": "DoRA adapters",
        "modules_to_save": "modules_to_save (fully trained copies of base modules)",
        "alpha_pattern": "per-module lora_alpha (alpha_pattern)",
    }
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{file}: {what} are not supported ({key} = {config[key]!r})")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"{file}: bias = {config['bias']!r} is not supported; tokenmill serves bias = 'none'")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted({str(t).rsplit(".", 1)[-1] for t in targets} - set(SUPPORTED_MODULES))
        if unknown:
            raise AdapterError(
                f"{file}: target_modules {unknown} are not supported; LoRA adapts "
                f"{', '.join(SUPPORTED_MODULES)}"
            )
    return config


def _positive_int(config: dict[str, Any], key: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise AdapterError(f"{CONFIG_FILE}: {key} must be a positive integer, got {value!r}")
    return value


def _tensor_shapes(weights: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(weights), framework="numpy") as f:
            shapes = {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                piece = f.get_slice(name)
                if piece.get_dtype() not in ("F32", "F16", "BF16"):
                    raise AdapterError(f"{weights}: tensor {name} has dtype {piece.get_dtype()}; expected F32, F16 or BF16")
                shapes[name] = tuple(piece.get_shape())
            return shapes
    except SafetensorError as exc:
        raise AdapterError(f"{weights} is not a readable safetensors file: {exc}") from None


def _pair_tensors(
    shapes: dict[str, tuple[int, ...]],
    weights: Path,
    arch: BaseShapes,
    base_rank: int,
    has_rank_pattern: bool,
    alpha: float,
    rslora: bool,
) -> tuple[ModuleAdapter, ...]:
    expected = module_shapes(arch)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name in shapes:
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise AdapterError(
                f"{weights}: tensor {name!r} is not a LoRA A/B weight of a decoder layer's module "
                "(embedding, lm_head or bias tensors are not supported)"
            )
        layer, _, module, which = match.groups()
        if module not in expected:
            supported = ", ".join(expected)
            raise AdapterError(f"{weights}: {name!r} adapts {module}, which LoRA cannot adapt on this {arch.architecture} model (supported: {supported})")
        if int(layer) >= arch.num_layers:
            raise AdapterError(f"{weights}: {name!r} is for layer {layer}, but the base model has {arch.num_layers} layers")
        pairs.setdefault((int(layer), module), {})[which] = name
    if not pairs:
        raise AdapterError(f"{weights} holds no LoRA tensors")
    modules = []
    for (layer, module), names in sorted(pairs.items()):
        if set(names) != {"A", "B"}:
            raise AdapterError(f"{weights}: layer {layer} {module} has lora_{''.join(names)} but not both A and B")
        a_shape, b_shape = shapes[names["A"]], shapes[names["B"]]
        out, inp = expected[module]
        rank = a_shape[0] if len(a_shape) == 2 else -1
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != inp or b_shape != (out, rank):
            raise AdapterError(
                f"{weights}: layer {layer} {module} has lora_A {list(a_shape)} and lora_B {list(b_shape)}; this base "
                f"model needs lora_A [r, {inp}] and lora_B [{out}, r]: the adapter was trained for another base model"
            )
        if rank != base_rank and not has_rank_pattern:
            raise AdapterError(f"{weights}: layer {layer} {module} has rank {rank}, but {CONFIG_FILE} says r = {base_rank}")
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        modules.append(ModuleAdapter(layer, module, names["A"], names["B"], rank, scale))
    return tuple(modules)
