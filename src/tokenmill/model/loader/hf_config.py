"""What an HF checkpoint directory says about itself (config.json, generation_config.json, which
*.safetensors or pytorch_model*.bin files hold the weights), read without torch for model resolution."""

from __future__ import annotations

import json
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
PT_INDEX_FILE = "pytorch_model.bin.index.json"
PT_WEIGHTS_GLOB = "pytorch_model*.bin"  # not *.bin: repositories also hold training_args.bin and the like


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


def indexed_weight_files(index_path: Path) -> list[str]:
    """The file names a sharded checkpoint's index (`*.index.json`) maps its tensors to."""
    with index_path.open() as f:
        weight_map: dict[str, str] = json.load(f)["weight_map"]
    return sorted(set(weight_map.values()))


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        return [model_dir / name for name in indexed_weight_files(index)]
    return sorted(model_dir.glob("*.safetensors"))


def pytorch_bin_files(model_dir: Path) -> list[Path]:
    """The PyTorch pickle checkpoint files (`pytorch_model.bin`, or the shards its index lists)."""
    index = model_dir / PT_INDEX_FILE
    if index.is_file():
        return [model_dir / name for name in indexed_weight_files(index)]
    return sorted(model_dir.glob(PT_WEIGHTS_GLOB))
