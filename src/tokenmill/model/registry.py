"""From a resolved model to a ready one: `load_model` builds the CausalLM on a device and fills
its weights. Finding the weights and reading the architecture (`resolve_model`) lives in the
torch-free `model.resolve`, re-exported here."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tokenmill.attention.backend import AttentionBackend
from tokenmill.config import KernelConfig, ModelConfig
from tokenmill.device import resolve_dtype
from tokenmill.distributed import parallel_state
from tokenmill.model.arch import ArchConfig
from tokenmill.model.gemma import GemmaCausalLM
from tokenmill.model.gpt_oss import GptOssCausalLM
from tokenmill.model.layers.linear import process_weights_after_loading
from tokenmill.model.layers.linear_select import exclude_unquantized_layers, select_linear_method
from tokenmill.model.layers.moe import process_experts_after_loading
from tokenmill.model.llama import CausalLM
from tokenmill.model.loader.dummy import init_dummy_weights
from tokenmill.model.loader.gguf_blocks import attach_gguf_blocks
from tokenmill.model.loader.gguf_loader import iter_gguf_quantized, iter_gguf_weights
from tokenmill.model.loader.pt_loader import iter_pt_weights
from tokenmill.model.loader.safetensors_loader import iter_safetensors_weights
from tokenmill.model.moe_models import MoECausalLM
from tokenmill.model.phi3 import Phi3ForCausalLM
from tokenmill.model.resolve import ResolvedModel, WeightFormat, resolve_model  # noqa: F401  (re-exported)
from tokenmill.model.tensor_parallel import check_tensor_parallel

# ArchConfig.architecture (the family) -> the module that implements it; a new family is one model
# file plus a line here (docs/adding-a-model.md).
MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": CausalLM,
    "mistral": CausalLM,
    "qwen2": CausalLM,
    "qwen3": CausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma2": GemmaCausalLM,
    "gemma3": GemmaCausalLM,
    "mixtral": MoECausalLM,
    "qwen2_moe": MoECausalLM,
    "qwen3_moe": MoECausalLM,
    "gpt_oss": GptOssCausalLM,
}

logger = logging.getLogger(__name__)


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
    quantization = resolved.quantization
    linear_method = select_linear_method(device, dtype, kernel, quantization)
    check_tensor_parallel(arch, parallel_state.tp_size(), quantization)
    model_class = MODEL_CLASSES.get(arch.architecture)
    if model_class is None:
        raise ValueError(
            f"no model class for the {arch.architecture!r} family; known: {', '.join(MODEL_CLASSES)}"
        )
    model = model_class(
        arch, attn_backend, device=device, dtype=dtype, max_positions=max_positions, kernel=kernel,
        linear_method=linear_method,
    )  # fmt: skip
    if quantization is not None:
        kept = exclude_unquantized_layers(model, _linear_hf_names(model), device, dtype)
        logger.info("linear layers: %s; %d layer(s) left 16-bit (lm_head, ignored)", quantization.describe(), kept)
    reads_gguf_blocks = (
        device.type == "cpu"
        and dtype == torch.float32
        and resolved.format == "gguf"
        and model_config.load_format != "dummy"
        and kernel.cpu_quantized_gemv
        and quantization is None  # --quantization replaces the GGUF's own blocks
        and parallel_state.tp_size() == 1  # the blocks hold whole matrices, not a rank's shard
    )
    requantized: dict = {}  # GGUF blocks the kernels do not read, as Q8_0, made while loading the floats
    if resolved.format == "dummy" or model_config.load_format == "dummy":
        init_dummy_weights(model, seed=model_config.seed)
    elif resolved.format == "gguf":
        model.load_weights(iter_gguf_weights(resolved.path, arch, requantized if reads_gguf_blocks else None))
    elif resolved.format == "pt":
        model.load_weights(iter_pt_weights(Path(resolved.path)))
    else:
        model.load_weights(iter_safetensors_weights(Path(resolved.path), device))
    if quantization is not None and not quantization.from_checkpoint:
        # Quantized at load: the norm weights fold into the 16-bit weights, then those are quantized
        # (QuantizedLinearMethod.folds_input_scale); the call below then finds them folded.
        model.fold_norm_weights()
    process_weights_after_loading(model)
    process_experts_after_loading(model)  # FP8 experts: the kernels' form, or dequantized
    model.fold_norm_weights()  # where the linear methods can (CUDA)
    if reads_gguf_blocks:
        _attach_gguf_blocks(
            model, resolved.path, arch, kernel.cpu_quantized_gemm_rows, kernel.cpu_activation_bits,
            kernel.cpu_quantized_prefill, requantized,
        )  # fmt: skip
    return model.eval()


def _linear_hf_names(model: CausalLM) -> dict[int, list[str]]:
    """id(linear layer) -> the Hugging Face module names whose weights it loads ("lm_head" for
    lm_head, tied or not)."""
    names: dict[int, list[str]] = {}
    for name in model._expected_weight_names():
        target = model.linear_for_weight(name)
        if target is None:
            continue
        layer = target[0]
        module = "lm_head" if layer is model.lm_head else name.removesuffix(".weight")
        names.setdefault(id(layer), []).append(module)
    return names


def _attach_gguf_blocks(
    model: CausalLM,
    path: str,
    arch: ArchConfig,
    gemm_rows: int,
    activation_bits: int,
    prefill: bool = False,
    requantized: dict | None = None,
) -> None:
    """One-row matmuls from the GGUF's Q4_1 / Q8_0 blocks, when the CPU kernels build; batched ones
    up to `gemm_rows` rows, or (`prefill`) every row count where the build's kernel is the faster."""
    from tokenmill.kernels.cpu.build import cpu_kernels_available

    available, why = cpu_kernels_available()
    if not available:
        logger.warning("GGUF weights stay float32 for few-row steps (%s)", why)
        return
    from tokenmill.kernels.cpu.quant_gemv import (
        ALL_ROWS,
        blocks_rows_limit,
        int8_rows_limit,
        prefill_rows_limit,
        rows_limit,
    )

    if rows_limit() < 1:
        logger.info("GGUF weights stay float32: this CPU has no AVX2/AVX-512 path for quantized matmuls")
        return
    from tokenmill.kernels.cpu.quant_gemv_int8 import int8_available, int8_isa

    bits = activation_bits if int8_available() else 0
    if prefill:
        gemm_rows = prefill_rows_limit(gemm_rows, integer_activations=bits > 0)
    attached = attach_gguf_blocks(model, iter_gguf_quantized(path, arch, requantized), gemm_rows, bits)
    if attached:
        limit = blocks_rows_limit(gemm_rows)
        logger.info(
            "matmuls of up to %s rows read the GGUF's quantized blocks (%.0f MiB); up to %d rows with %s activations",
            "any number of" if limit >= ALL_ROWS else limit,
            attached / 2**20,
            min(int8_rows_limit() if bits else rows_limit(), limit),
            f"{bits}-bit integer ({int8_isa().upper()})" if bits else "float32",
        )
