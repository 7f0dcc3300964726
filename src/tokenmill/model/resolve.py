"""From a ModelConfig to a ResolvedModel: where the weights are, their format, the architecture.

Torch-free on purpose: the API server process resolves the model (for the tokenizer, the EOS
ids, the served name) and never imports torch or the model code; `registry.load_model` builds
the CausalLM from a ResolvedModel in the engine process.

A model is a local HF directory or .gguf file, or a Hugging Face Hub id (`ORG/NAME`,
`ORG/NAME/FILE.gguf`) fetched into the Hub's cache (`loader/hub.py`); a local path that exists
always wins. A quantized checkpoint whose method tokenmill cannot run is refused here, before any
weight is read (`loader/quant_config.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenmill.config import ModelConfig
from tokenmill.errors import ModelNotFoundError, UnsupportedModelError
from tokenmill.model.arch import ArchConfig
from tokenmill.model.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from tokenmill.model.loader.gguf_metadata import gguf_arch_config
from tokenmill.model.loader.hf_config import (
    pytorch_bin_files,
    read_generation_eos,
    read_hf_config,
    safetensors_files,
)
from tokenmill.model.loader.hub import download
from tokenmill.model.loader.hub_files import HubModelId, Purpose
from tokenmill.model.loader.quant_config import (
    QuantizationSpec,
    check_quantization_config,
    resolve_quantization,
)

logger = logging.getLogger(__name__)

WeightFormat = Literal["safetensors", "pt", "gguf", "dummy"]


# The families whose linear layers take quantized methods: the Llama decoder's (model/llama.py),
# and its mixture-of-experts variants, whose routed experts take FP8 and 4-bit weights
# (layers/moe_fp8.py, moe_int4.py; not act-order 4-bit). gpt-oss and the families with their own weight layouts (Phi-3's
# fused projections, Gemma) are refused until their loaders map quantized tensors.
_QUANTIZABLE_FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe", "qwen3_moe"
)


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: str  # the HF directory or the .gguf file holding the weights (or just the config, for dummy)
    format: WeightFormat
    arch: ArchConfig
    tokenizer_path: str  # an HF directory or a .gguf file
    name: str  # the name to serve it under
    # Hub ids: the commits their revisions resolved to (None for local paths and the default model).
    revision: str | None = None
    tokenizer_revision: str | None = None
    # How its linear layers are quantized (model/loader/quant_config.py); None: 16-bit.
    quantization: QuantizationSpec | None = None


def _check_quantizable(arch: ArchConfig, quantization: QuantizationSpec) -> None:
    """UnsupportedModelError (param quantization) for a family or a scheme whose layers cannot take
    `quantization`, before any weight loads."""
    if arch.architecture not in _QUANTIZABLE_FAMILIES:
        raise UnsupportedModelError(
            f"{quantization.method} quantization of a {arch.architecture} model is not supported yet: quantized "
            f"linear layers run in {', '.join(_QUANTIZABLE_FAMILIES)}; serve its 16-bit checkpoint",
            param="quantization",
        )
    if arch.moe is not None and quantization.scheme == "int4_w4a16" and quantization.act_order:
        raise UnsupportedModelError(
            f"{quantization.describe()} for a {arch.architecture} model is not supported yet: 4-bit "
            "mixture-of-experts experts are read in group order, and act-order (a permuted g_idx) is not; "
            "use a checkpoint quantized without desc_act / actorder group, or an FP8 one",
            param="quantization",
        )


def resolve_model(model_config: ModelConfig) -> ResolvedModel:
    """Locate the model named by `model_config` (None = the default model) and read its architecture."""
    load_format = model_config.load_format
    revision: str | None = None
    if model_config.model is None:
        path = default_model_path()
        default_name = DEFAULT_MODEL_NAME
    else:
        path, revision = _locate(
            model_config.model, model_config.revision, model_config.download_dir, load_format, "model"
        )
        if revision is not None:  # a Hub id is served under its id
            default_name = model_config.model
        else:
            default_name = path.stem if path.is_file() else path.name

    if path.is_dir() and load_format in ("auto", "gguf") and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1 or (ggufs and load_format == "gguf"):
            path = ggufs[0]
    is_gguf = path.is_file() and path.suffix == ".gguf"

    source = model_config.model or str(path)
    if is_gguf:
        quantization = resolve_quantization(None, model_config.quantization, source)
        arch = gguf_arch_config(path)
        weight_format: WeightFormat = "dummy" if load_format == "dummy" else "gguf"
        if load_format in ("safetensors", "pt"):
            raise ValueError(f"load_format={load_format!r} but {path} is a GGUF file")
    elif path.is_dir():
        if load_format == "gguf":
            raise ValueError(f"load_format='gguf' but {path} holds no .gguf file")
        hf_config = read_hf_config(path)
        quantization = resolve_quantization(
            hf_config, model_config.quantization, source, dummy=load_format == "dummy"
        )
        arch = ArchConfig.from_hf_config(hf_config)
        extra_eos = [e for e in read_generation_eos(path) if e not in arch.eos_token_ids]
        arch = dataclasses.replace(arch, eos_token_ids=arch.eos_token_ids + tuple(extra_eos))
        weight_format = _weight_format(path, load_format)
    else:
        raise ValueError(f"{path} is neither a model directory nor a .gguf file")

    if quantization is not None:
        _check_quantizable(arch, quantization)
    tokenizer_path, tokenizer_revision = str(path), None
    if model_config.tokenizer is not None:
        tokenizer, tokenizer_revision = _locate(
            model_config.tokenizer, model_config.tokenizer_revision, model_config.download_dir, "auto", "tokenizer"
        )
        tokenizer_path = str(tokenizer)
    return ResolvedModel(
        path=str(path),
        format=weight_format,
        arch=arch,
        tokenizer_path=tokenizer_path,
        name=model_config.served_model_name or default_name,
        revision=revision,
        tokenizer_revision=tokenizer_revision,
        quantization=quantization,
    )


def pin_snapshots(model_config: ModelConfig, resolved: ResolvedModel) -> ModelConfig:
    """`model_config` with its Hub revisions replaced by the commits `resolved` found: the config the
    API server gives the engine process, so that both load the same snapshot even if a branch moves
    meanwhile, and the engine finds it in the cache without asking the Hub."""
    return dataclasses.replace(
        model_config,
        revision=resolved.revision or model_config.revision,
        tokenizer_revision=resolved.tokenizer_revision or model_config.tokenizer_revision,
    )


def locate_model_dir(name: str, revision: str | None, download_dir: str | None) -> Path:
    """A model directory from a local path or a Hub id (downloaded, or from the cache): for models
    that are not served on their own (a speculative-decoding drafter)."""
    return _locate(name, revision, download_dir, "auto", "model")[0]


def _locate(
    name: str, revision: str | None, download_dir: str | None, load_format: str, purpose: Purpose
) -> tuple[Path, str | None]:
    """(the local path of `name`, the commit it was fetched at, or None for a local path)."""
    local = Path(name).expanduser()
    if local.exists():
        if revision is not None:
            logger.warning("%s %s is a local path: its revision %r is ignored (Hub ids only)", purpose, name, revision)
        return local, None
    hub_id = HubModelId.parse(name)
    if hub_id is None:
        raise ModelNotFoundError(
            f"{purpose} {name!r} not found: expected a local Hugging Face directory, a .gguf file, or a "
            "Hugging Face Hub id ORG/NAME (or ORG/NAME/FILE.gguf)",
            param=purpose,
        )
    check = _refuse_unsupported_config(name) if purpose == "model" else None
    snapshot = download(
        hub_id, revision=revision, cache_dir=download_dir, load_format=load_format, purpose=purpose,
        check_metadata=check,
    )  # fmt: skip
    return snapshot.path, snapshot.commit


def _refuse_unsupported_config(source: str) -> Callable[[Path], None]:
    """The check a Hub model's config.json passes before its weights are fetched: its quantization
    method and its architecture (resolve_model checks them again, cheaply, for every model)."""

    def check(directory: Path) -> None:
        if (directory / "config.json").is_file():
            hf_config = read_hf_config(directory)
            check_quantization_config(hf_config, source=source)
            ArchConfig.from_hf_config(hf_config)

    return check


def _weight_format(path: Path, load_format: str) -> WeightFormat:
    """safetensors before pytorch_model*.bin when both are there (no pickle at all); dummy: neither."""
    if load_format == "dummy":
        return "dummy"
    if load_format in ("auto", "safetensors") and safetensors_files(path):
        return "safetensors"
    if load_format in ("auto", "pt") and pytorch_bin_files(path):
        return "pt"
    wanted = {"safetensors": "*.safetensors", "pt": "pytorch_model*.bin"}.get(
        load_format, "*.safetensors or pytorch_model*.bin"
    )
    raise FileNotFoundError(
        f"no {wanted} weights in {path}; pass load_format='dummy' to run with random weights"
    )
