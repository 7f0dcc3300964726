"""Dummy PEFT LoRA adapters at a base model's shapes, for benchmarks (no training, no peft needed).

Each adapter is a directory as PEFT's `save_pretrained` writes it: `adapter_config.json` and
`adapter_model.safetensors` with `base_model.model.model.layers.<i>.<block>.<module>.lora_{A,B}.weight`
([r, in] and [out, r]). The weights are random and small, so a benchmark runs the adapters' real
matmuls at the real shapes without knowing any fine-tune. They pass
`tokenmill.lora.adapter_files.read_adapter` and load in peft.

At Llama-3.1-8B shapes, rank 16 on all seven modules, one bf16 adapter is ~84 MB; torch's random
fill makes it in a fraction of a second, one file at a time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from tokenmill.lora.adapter_files import (
    ATTENTION_MODULES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    module_shapes,
    read_adapter,
)
from tokenmill.model.arch import ArchConfig

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPES = ("bfloat16", "float16", "float32")
_SAFETENSORS_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def arch_of_model_dir(model_dir: str | Path) -> ArchConfig:
    """The ArchConfig of a local HF model directory (its config.json), e.g. benchmarks/configs/llama-3.1-8b."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config} does not exist; pass a model directory holding an HF config.json")
    return ArchConfig.from_hf_config(json.loads(config.read_text()))


def adapter_name(index: int) -> str:
    """The directory name (and served name) of the index-th dummy adapter."""
    return f"lora-{index:03d}"


def adapter_num_params(arch: ArchConfig, rank: int, targets: Sequence[str] = ALL_TARGETS) -> int:
    """Parameters of one adapter: rank x (in + out) per targeted module and layer."""
    shapes = _checked_shapes(arch, targets)
    return arch.num_layers * sum(rank * (out + inp) for out, inp in (shapes[t] for t in targets))


def write_dummy_adapter(
    path: str | Path,
    arch: ArchConfig,
    rank: int,
    *,
    targets: Sequence[str] = ALL_TARGETS,
    dtype: str = "bfloat16",
    seed: int = 0,
    b_scale: float = 0.01,
    lora_alpha: float | None = None,
    layers: Sequence[int] | None = None,
    base_model_name: str | None = None,
) -> Path:
    """One random adapter of `rank` for `targets` of `layers` (default: every layer) into `path`.

    A is uniform in +-1/sqrt(in) (PEFT's kaiming-uniform scale), B uniform in +-b_scale (PEFT
    starts B at zero, which would make the adapter a no-op; a small B keeps the model's output
    close to the base's). lora_alpha defaults to the rank: scale 1.
    """
    import torch
    from safetensors.torch import save_file

    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    shapes = _checked_shapes(arch, targets)
    layer_ids = list(range(arch.num_layers)) if layers is None else sorted(set(layers))
    bad = [i for i in layer_ids if not 0 <= i < arch.num_layers]
    if bad or not layer_ids:
        raise ValueError(f"layers {bad or '[]'} are not among the model's {arch.num_layers} layers")
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in layer_ids:
        for module in targets:
            out, inp = shapes[module]
            block = "self_attn" if module in ATTENTION_MODULES else "mlp"
            prefix = f"base_model.model.model.layers.{i}.{block}.{module}"
            bound = 1.0 / math.sqrt(inp)
            tensors[f"{prefix}.lora_A.weight"] = _uniform((rank, inp), bound, gen, torch_dtype)
            tensors[f"{prefix}.lora_B.weight"] = _uniform((out, rank), b_scale, gen, torch_dtype)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": rank,
        "lora_alpha": float(rank if lora_alpha is None else lora_alpha),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "target_modules": list(targets),
        "layers_to_transform": None if layers is None else layer_ids,
    }
    # Weights first, config last: a directory with a config has its weights (see _reusable).
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory


def write_dummy_adapters(
    root: str | Path,
    arch: ArchConfig,
    num: int,
    rank: int,
    *,
    targets: Sequence[str] = ALL_TARGETS,
    dtype: str = "bfloat16",
    seed: int = 0,
    progress: bool = True,
    base_model_name: str | None = None,
) -> list[Path]:
    """`num` adapters in root/lora-000, lora-001, ... (adapter i seeded with seed + i).

    An adapter already there with this rank, these targets and dtype, valid for `arch`, is kept:
    a set of 32 serves a later run of 8 (the first 8), and runs of a sweep share one directory.
    """
    from tqdm import tqdm

    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    _checked_shapes(arch, targets)
    root = Path(root)
    paths = [root / adapter_name(i) for i in range(num)]
    todo = [i for i, p in enumerate(paths) if not _reusable(p, arch, rank, targets, dtype)]
    mb = adapter_num_params(arch, rank, targets) * _itemsize(dtype) / 1e6
    bar = tqdm(
        todo, desc=f"writing LoRA adapters (rank {rank}, {mb:.0f} MB each)", unit="adapter", disable=not (progress and todo)
    )
    for i in bar:
        write_dummy_adapter(
            paths[i], arch, rank, targets=targets, dtype=dtype, seed=seed + i, base_model_name=base_model_name
        )
    return paths


def _reusable(path: Path, arch: ArchConfig, rank: int, targets: Sequence[str], dtype: str) -> bool:
    if not (path / CONFIG_FILE).is_file():
        return False
    try:
        spec = read_adapter(path, arch, rank)
    except AdapterError:
        return False  # another model's or a damaged adapter: written anew
    if spec.rank != rank or set(spec.target_modules) != set(targets):
        return False
    if len(spec.modules) != arch.num_layers * len(set(targets)):  # a subset of layers
        return False
    from safetensors import safe_open

    with safe_open(str(spec.weights_file), framework="numpy") as f:
        return f.get_slice(spec.modules[0].a_name).get_dtype() == _SAFETENSORS_DTYPE[dtype]


def _checked_shapes(arch: ArchConfig, targets: Sequence[str]) -> dict[str, tuple[int, int]]:
    shapes = module_shapes(arch)
    if not targets:
        raise ValueError("targets is empty; name at least one module, e.g. q_proj")
    if len(set(targets)) != len(targets):
        raise ValueError(f"targets {list(targets)} name a module twice")
    unknown = [t for t in targets if t not in shapes]
    if unknown:
        raise ValueError(
            f"targets {unknown} are not adaptable on this {arch.architecture} model; choose among {', '.join(shapes)}"
        )
    return shapes


def _uniform(shape: tuple[int, int], bound: float, gen, dtype):  # noqa: ANN001, ANN202 - torch types, imported late
    import torch

    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen).to(dtype)


def _itemsize(dtype: str) -> int:
    return 4 if dtype == "float32" else 2
