"""From a ModelConfig to a ready model: find the weights, describe the architecture, load.

`resolve_model` is cheap and torch-free in what it returns (paths, format, ArchConfig), so the
API server process can use it for the tokenizer; `load_model` builds the CausalLM on a device.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import KernelConfig, ModelConfig
from tokenmill.device import resolve_dtype
from tokenmill.errors import ModelNotFoundError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.layers.linear import process_weights_after_loading
from tokenmill.model.layers.linear_select import select_linear_method
from tokenmill.model.llama import CausalLM
from tokenmill.model.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from tokenmill.model.loader.dummy import init_dummy_weights
from tokenmill.model.loader.gguf_blocks import attach_gguf_blocks
from tokenmill.model.loader.gguf_loader import gguf_arch_config, iter_gguf_quantized, iter_gguf_weights
from tokenmill.model.loader.safetensors_loader import (
    iter_safetensors_weights,
    read_generation_eos,
    read_hf_config,
    safetensors_files,
)

WeightFormat = Literal["safetensors", "gguf", "dummy"]

# ArchConfig.architecture (the family) -> the module that implements it; a new family is one model
# file plus a line here (docs/adding-a-model.md).
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "mistral": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
}

logger = logging.getLogger(__name__)


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


def load_model(
    model_config: ModelConfig,
    arch: ArchConfig,
    device: torch.device | str,
    dtype: torch.dtype | str,
    attn_backend: AttentionBackend,
    *,
    resolved: ResolvedModel | None = None,
    kernel: KernelConfig | None = None,
) -> CausalLM:
    """Build the CausalLM for `arch` on `device` and fill its weights (or random ones for dummy).

    Pass `resolved` when you already have it, to skip resolving again.
    """
    resolved = resolved or resolve_model(model_config)
    kernel = kernel or KernelConfig()
    device = torch.device(device)
    dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, device)
    max_positions = model_config.max_model_len or arch.max_position_embeddings
    linear_method = select_linear_method(device, dtype, kernel)
    model_class = MODEL_CLASSES.get(arch.architecture)
    if model_class is None:
        raise ValueError(
            f"no model class for the {arch.architecture!r} family; known: {', '.join(MODEL_CLASSES)}"
        )
    model = model_class(
        arch, attn_backend, device=device, dtype=dtype, max_positions=max_positions, kernel=kernel,
        linear_method=linear_method,
    )  # fmt: skip
    if resolved.format == "dummy" or model_config.load_format == "dummy":
        init_dummy_weights(model, seed=model_config.seed)
    elif resolved.format == "gguf":
        model.load_weights(iter_gguf_weights(resolved.path, arch))
    else:
        model.load_weights(iter_safetensors_weights(Path(resolved.path), device))
    process_weights_after_loading(model)
    model.fold_norm_weights()  # where the linear methods can (CUDA)
    if (
        device.type == "cpu"
        and dtype == torch.float32
        and resolved.format == "gguf"
        and model_config.load_format != "dummy"
        and kernel.cpu_quantized_gemv
    ):
        _attach_gguf_blocks(model, resolved.path, arch)
    return model.eval()


def _attach_gguf_blocks(model: CausalLM, path: str, arch: ArchConfig) -> None:
    """One-row matmuls from the GGUF's Q4_1 / Q8_0 blocks, when the CPU kernels build."""
    from tokenmill.kernels.cpu.build import cpu_kernels_available

    available, why = cpu_kernels_available()
    if not available:
        logger.warning("GGUF weights stay float32 for few-row steps (%s)", why)
        return
    from tokenmill.model.layers.quantized_linear import rows_limit

    if rows_limit() < 1:
        logger.info("GGUF weights stay float32: this CPU has no AVX2/AVX-512 path for quantized matmuls")
        return
    attached = attach_gguf_blocks(model, iter_gguf_quantized(path, arch))
    if attached:
        logger.info(
            "matmuls of up to %d rows read the GGUF's quantized blocks (%.0f MiB)",
            rows_limit(),
            attached / 2**20,
        )
