"""Quantized Hugging Face checkpoints: which `quantization_config` methods tokenmill runs, checked
at resolve time, torch-free, before any weight is read.

A checkpoint written by a quantization tool says so in its config.json
(`"quantization_config": {"quant_method": "awq", ...}`). Its tensors are not the float weights the
16-bit linear methods take (packed int4 with scales and zeros, fp8 with per-channel scales, ...):
loaded as floats they would fail deep inside the loader with a shape error, or worse, load. So the
method is checked here, in `resolve_model`, and the API server refuses such a model before the
engine process starts.

`SUPPORTED_QUANTIZATION_METHODS` is the registry: `quant_method` name -> the linear method that
runs it (its class name, as text: this module stays torch-free). It is empty today; a quantized
linear method (FP8, compressed-tensors, AWQ, GPTQ) adds its line here together with its loader and
its branch in `select_linear_method`. GGUF files carry their own quantization and are not checked
here.
"""

from __future__ import annotations

from tokenmill.errors import UnsupportedModelError

SUPPORTED_QUANTIZATION_METHODS: dict[str, str] = {}


def quantization_method(hf_config: dict) -> str | None:
    """The checkpoint's `quantization_config.quant_method` (lower-cased), or None if it is not quantized."""
    quant = hf_config.get("quantization_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if not isinstance(method, str) or not method:
        raise UnsupportedModelError(
            f"config.json has a quantization_config without a quant_method ({quant!r}); a quantized "
            "checkpoint names its method there (e.g. 'fp8', 'awq', 'gptq', 'compressed-tensors')"
        )
    return method.lower()


def check_quantization_config(hf_config: dict, source: str) -> str | None:
    """The quantization method of the checkpoint at `source` (None: not quantized); raises
    UnsupportedModelError naming the method and the supported ones when tokenmill cannot run it."""
    method = quantization_method(hf_config)
    if method is None or method in SUPPORTED_QUANTIZATION_METHODS:
        return method
    supported = ", ".join(sorted(SUPPORTED_QUANTIZATION_METHODS)) or "none yet"
    raise UnsupportedModelError(
        f"{source} is a quantized checkpoint (quantization_config.quant_method = {method!r}), and tokenmill "
        f"cannot run {method!r} weights; supported quantization methods: {supported}. Load the model's "
        "unquantized (16-bit) checkpoint instead, or a GGUF file of it",
        param="model",
    )
