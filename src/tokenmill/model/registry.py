"""From a resolved model to a ready one: `load_model` builds the CausalLM on a device and fills
its weights. Finding the weights and reading the architecture (`resolve_model`) lives in the
torch-free `model.resolve`, re-exported here."""

from __future__ import annotations

import dataclasses
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
    blocks_plan = _gguf_blocks_plan(kernel) if reads_gguf_blocks else None
    float_free: set[str] = set()
    if blocks_plan is not None and blocks_plan.serves_every_row:
        # The blocks serve every product: attach them first, and the float32 weights they replace are
        # never read from the file nor filled (a GGUF loads in about its own size, not 4 bytes a weight).
        float_free = _attach_gguf_blocks(model, resolved.path, arch, blocks_plan, before_loading=True)
    # Blocks attached after the floats load: the K-quants' Q8_0 rows, made from the same dequantization.
    requantized: dict | None = {} if blocks_plan is not None and not blocks_plan.serves_every_row else None
    if resolved.format == "dummy" or model_config.load_format == "dummy":
        init_dummy_weights(model, seed=model_config.seed)
    elif resolved.format == "gguf":
        model.load_weights(iter_gguf_weights(resolved.path, arch, requantized, skip=float_free))
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
    if blocks_plan is not None and requantized is not None:  # the blocks serve few rows: attached last
        _attach_gguf_blocks(model, resolved.path, arch, blocks_plan, requantized)
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


@dataclasses.dataclass(frozen=True)
class _GGUFBlocksPlan:
    gemm_rows: int  # blocks serve products of up to blocks_rows_limit(gemm_rows) rows
    activation_bits: int  # 0: float32 activations; 8 / 16: integer ones (quant_gemv_int8)
    serves_every_row: bool


def _gguf_blocks_plan(kernel: KernelConfig) -> _GGUFBlocksPlan | None:
    """How this CPU's kernels read a GGUF's Q4_1 / Q8_0 blocks: one-row matmuls, batched ones up to
    `cpu_quantized_gemm_rows` rows, or (`cpu_quantized_prefill`) every row count where the build's
    kernel is the faster; None where they cannot (said in the log)."""
    from tokenmill.kernels.cpu.build import cpu_kernels_available

    available, why = cpu_kernels_available()
    if not available:
        logger.warning("GGUF weights stay float32 for few-row steps (%s)", why)
        return None
    from tokenmill.kernels.cpu.quant_gemv import ALL_ROWS, blocks_rows_limit, prefill_rows_limit, rows_limit

    if rows_limit() < 1:
        logger.info("GGUF weights stay float32: this CPU has no AVX2/AVX-512 path for quantized matmuls")
        return None
    from tokenmill.kernels.cpu.quant_gemv_int8 import int8_available

    bits = kernel.cpu_activation_bits if int8_available() else 0
    gemm_rows = kernel.cpu_quantized_gemm_rows
    if kernel.cpu_quantized_prefill:
        gemm_rows = prefill_rows_limit(gemm_rows, integer_activations=bits > 0)
    return _GGUFBlocksPlan(gemm_rows, bits, blocks_rows_limit(gemm_rows) >= ALL_ROWS)


def _attach_gguf_blocks(
    model: CausalLM,
    path: str,
    arch: ArchConfig,
    plan: _GGUFBlocksPlan,
    requantized: dict | None = None,
    before_loading: bool = False,
) -> set[str]:
    """Give the linear layers the GGUF's blocks (`requantized`: Q8_0 rows iter_gguf_weights made);
    returns the HF names of the weights no longer loaded as floats (`before_loading`)."""
    from tokenmill.kernels.cpu.quant_gemv import ALL_ROWS, blocks_rows_limit, int8_rows_limit, rows_limit
    from tokenmill.kernels.cpu.quant_gemv_int8 import int8_isa

    names: list[str] = []

    def noting_names(quantized):
        for item in quantized:
            names.append(item[0])
            yield item

    bits = plan.activation_bits
    attached = attach_gguf_blocks(
        model, noting_names(iter_gguf_quantized(path, arch, requantized)), plan.gemm_rows, bits, before_loading
    )
    if attached:
        limit = blocks_rows_limit(plan.gemm_rows)
        logger.info(
            "matmuls of up to %s rows read the GGUF's quantized blocks (%.0f MiB)%s; up to %d rows with %s activations",
            "any number of" if limit >= ALL_ROWS else limit,
            attached / 2**20,
            ", not float32 copies" if before_loading else "",
            min(int8_rows_limit() if bits else rows_limit(), limit),
            f"{bits}-bit integer ({int8_isa().upper()})" if bits else "float32",
        )
    float_free = set()
    for name in names:
        target = model.linear_for_weight(name)
        if target is not None and "weight" not in target[0].checkpoint_params:
            float_free.add(name)
    return float_free
