"""From a ModelConfig to a ResolvedModel: where the weights are, their format, the architecture.

Torch-free on purpose: the API server process resolves the model (for the tokenizer, the EOS
ids, the served name) and never imports torch or the model code; `registry.load_model` builds
the CausalLM from a ResolvedModel in the engine process.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelNotFoundError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from tokenmill.model.loader.gguf_metadata import gguf_arch_config
from tokenmill.model.loader.hf_config import read_generation_eos, read_hf_config, safetensors_files

WeightFormat = Literal["safetensors", "gguf", "dummy"]


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: str  # the HF directory or the .gguf file holding the weights (or just the config, for dummy)
    format: WeightFormat
    arch: ArchConfig
    tokenizer_path: str  # an HF directory or a .gguf file
    name: str  # the name to serve it under


def resolve_model(model_config: ModelConfig) -> ResolvedModel:
    """Locate the model named by `model_config` (None = the default model) and read its architecture."""
    load_format = model_config.load_format
    if model_config.model is None:
        path = default_model_path()
        default_name = DEFAULT_MODEL_NAME
    else:
        path = Path(model_config.model).expanduser()
        if not path.exists():
            raise ModelNotFoundError(
                f"model {model_config.model!r} not found: expected a local Hugging Face directory or a .gguf "
                "file (tokenmill does not download from a model hub)",
                param="model",
            )
        default_name = path.stem if path.is_file() else path.name

    if path.is_dir() and load_format in ("auto", "gguf") and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 or (ggufs and load_format == "gguf"):
            path = ggufs[0]
    is_gguf = path.is_file() and path.suffix == ".gguf"

    if is_gguf:
        arch = gguf_arch_config(path)
        weight_format: WeightFormat = "dummy" if load_format == "dummy" else "gguf"
        if load_format == "safetensors":
            raise ValueError(f"load_format='safetensors' but {path} is a GGUF file")
    elif path.is_dir():
        if load_format == "gguf":
            raise ValueError(f"load_format='gguf' but {path} holds no .gguf file")
        arch = ArchConfig.from_hf_config(read_hf_config(path))
        extra_eos = [e for e in read_generation_eos(path) if e not in arch.eos_token_ids]
        arch = dataclasses.replace(arch, eos_token_ids=arch.eos_token_ids + tuple(extra_eos))
        if load_format == "dummy":
            weight_format = "dummy"
        elif safetensors_files(path):
            weight_format = "safetensors"
        else:
            raise FileNotFoundError(
                f"no *.safetensors weights in {path}; pass load_format='dummy' to run with random weights"
            )
    else:
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")

    tokenizer_path = model_config.tokenizer or str(path)
    return ResolvedModel(
        path=str(path),
        format=weight_format,
        arch=arch,
        tokenizer_path=tokenizer_path,
        name=model_config.served_model_name or default_name,
    )
