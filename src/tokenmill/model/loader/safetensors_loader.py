"""HF checkpoint directories: config.json plus one or several *.safetensors files."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tokenmill.model.loader.hf_config import (  # noqa: F401  (re-exported: older import paths)
    INDEX_FILE,
    read_generation_eos,
    read_hf_config,
    safetensors_files,
)


def iter_safetensors_weights(model_dir: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor, one at a time, read onto `device` when it is a GPU."""
    files = safetensors_files(model_dir)
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors files in {model_dir}; pass load_format='dummy' to run with random weights"
        )
    if device.type == "cuda":
        read_device = f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    else:
        read_device = "cpu"
    for file in files:
        with safe_open(str(file), framework="pt", device=read_device) as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, shard.get_tensor(name)
