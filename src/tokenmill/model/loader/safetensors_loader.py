"""HF checkpoint directories: config.json plus one or several *.safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


def read_hf_config(model_dir: Path) -> dict:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; expected a Hugging Face model directory")
    with config_path.open() as f:
        return json.load(f)


def read_generation_eos(model_dir: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (often more than config.json lists, e.g. <|eot_id|>)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return ()
    with path.open() as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


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
