"""Quantized weights: what `--quantization` and a checkpoint's `quantization_config` ask for, checked
at resolve time, torch-free, before any weight is read.

A checkpoint written by a quantization tool says so in its config.json
(`"quantization_config": {"quant_method": "awq", ...}`). Its tensors are not the float weights the
16-bit linear methods take (packed int4 with scales and zeros, fp8 with scales, ...): loaded as
floats they would fail deep inside the loader with a shape error, or worse, load. So the config is
parsed here, in `resolve_model`, into one `QuantizationSpec`, and anything tokenmill cannot run
(a method, a bit width, a group size, a scheme) is an error naming it, raised in the API server
before the engine process starts.

Two ways in:
- a quantized checkpoint (compressed-tensors FP8 or 4-bit `pack-quantized`, Hugging Face `fp8`, AWQ,
  GPTQ): its tensors load as they are (`from_checkpoint`); `--quantization`, if given, must name the same method;
- `--quantization fp8 | awq | gptq` on a 16-bit checkpoint, a GGUF file or dummy weights: the
  weights are quantized at load, round to nearest (FP8: per-channel scales; AWQ: 4-bit groups of
  128 with zero points; GPTQ: symmetric 4-bit groups of 128). No calibration: for benchmarks and
  quick tries; a calibrated checkpoint is the better model.

The linear methods that run a spec are in model/layers/quantized_methods.py (FP8 W8A8 and INT4
W4A16); `QUANTIZATION_METHODS` names what each `quant_method` becomes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from tokenmill.config import QUANTIZATION_METHODS  # --quantization's choices = the quant_methods we run
from tokenmill.errors import UnsupportedModelError

if TYPE_CHECKING:
    from tokenmill.model.arch import ArchConfig

INT4_GROUP_SIZES = (32, 64, 128, -1)  # -1: one group over the whole input (per-channel)
FP8_BLOCK = (128, 128)

Scheme = Literal["fp8_w8a8", "int4_w4a16"]
Fp8WeightStrategy = Literal["tensor", "channel", "block"]
Int4Format = Literal["awq", "gptq", "pack-quantized"]  # pack-quantized: compressed-tensors' W4A16


@dataclass(frozen=True, slots=True)
class QuantizationSpec:
    """How a model's linear layers are quantized. Embeddings, norms and lm_head stay 16-bit, as do
    the layers `ignore` names."""

    method: str  # the --quantization / quant_method name: fp8 | awq | gptq | compressed-tensors
    scheme: Scheme
    from_checkpoint: bool  # the tensors are quantized on disk (False: quantize 16-bit weights at load)
    # FP8: how the checkpoint scales its weights; at load we use per-channel scales.
    fp8_weight_strategy: Fp8WeightStrategy = "channel"
    fp8_block: tuple[int, int] | None = None  # (rows, cols) of a block-scaled checkpoint's blocks
    fp8_scale_name: str = "weight_scale"  # HF `fp8` block checkpoints: weight_scale_inv
    # The checkpoint's static per-tensor activation scales (`input_scale`): read and checked, but
    # activations are quantized per token at run time (at least as accurate; see docs/QUANTIZATION.md).
    fp8_static_input_scales: bool = False
    # INT4
    int4_format: Int4Format | None = None  # the packed layout on disk (awq | gptq | pack-quantized)
    group_size: int = 128  # -1: per-channel
    zero_point: bool = True  # False: symmetric (zero = 8)
    # GPTQ desc_act, compressed-tensors actorder "group": g_idx permutes the input columns' groups
    act_order: bool = False
    gptq_zeros_offset: int = 1  # the original GPTQ format stores zero - 1; gptq_v2 stores zero
    ignore: tuple[str, ...] = ()  # HF module names left unquantized ("re:" prefix: a regular expression)
    kv_cache_scales: bool = False  # the checkpoint holds per-layer k_scale / v_scale

    def describe(self) -> str:
        """One line for logs and benchmark configs."""
        if self.scheme == "fp8_w8a8":
            layout = self.fp8_weight_strategy + (f" {self.fp8_block[0]}x{self.fp8_block[1]}" if self.fp8_block else "")
            source = "checkpoint" if self.from_checkpoint else "quantized at load"
            return f"{self.method}: FP8 W8A8 ({layout} weight scales, dynamic per-token activations; {source})"
        group = "per-channel" if self.group_size == -1 else f"groups of {self.group_size}"
        zeros = "zero points" if self.zero_point else "symmetric"
        source = f"{self.int4_format} checkpoint" if self.from_checkpoint else "round-to-nearest at load"
        order = ", act-order" if self.act_order else ""
        return f"{self.method}: INT4 W4A16 ({group}, {zeros}{order}; {source})"

    def is_ignored(self, module_name: str) -> bool:
        """Whether the HF module `module_name` (e.g. "model.layers.0.mlp.gate_proj") stays unquantized."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return True
            elif module_name == pattern or module_name.endswith("." + pattern):
                return True
        return False


def tensor_parallel_refusal(spec: object, arch: ArchConfig | None = None, size: int = 1) -> str | None:
    """Why weights quantized as `spec` cannot be split over `size` tensor-parallel ranks of `arch`;
    None when they can. Each rank loads its part of every checkpoint tensor (the layouts of
    model/layers/linear.py ParamLayout: output rows for column-parallel layers, input columns for
    row-parallel ones), or quantizes its own shard at load (FP8: a row-parallel shard's
    scales take the whole row's absmax). The shards must fall on the scheme's blocks: FP8 blocks
    and INT4 groups / packed words. Act-order checkpoints (GPTQ desc_act, compressed-tensors actorder
    "group": a permuted g_idx) are not sharded. (GGUF is no
    spec here: its blocks are dequantized at load.)"""
    if not isinstance(spec, QuantizationSpec):
        return f"quantized weights ({spec}) are not sharded for tensor parallelism yet; use tensor_parallel_size=1"
    what = f"quantized weights ({spec.describe()})"
    if spec.scheme == "int4_w4a16" and spec.act_order:
        return f"{what} are not sharded for tensor parallelism yet (act-order); use tensor_parallel_size=1"
    if arch is None or size == 1:
        return None
    heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
    # What one rank holds: output rows of the column-parallel parts, input columns of the row-parallel layers.
    rows = {
        "q_proj": heads * head_dim // size,
        "k_proj / v_proj": max(1, kv_heads // size) * head_dim,
        "gate_proj / up_proj": arch.intermediate_size // size,
    }
    columns = {"o_proj": heads * head_dim // size, "down_proj": arch.intermediate_size // size}
    if arch.moe is not None and spec.scheme == "int4_w4a16":
        return f"{what}: 4-bit mixture-of-experts experts are not sharded for tensor parallelism yet; use tensor_parallel_size=1"
    if arch.moe is not None:  # FP8 experts: each rank's share of each
        expert = arch.moe.expert_intermediate_size // size  # expert's gate / up rows and down columns
        rows["experts' gate_proj / up_proj"] = expert
        columns["experts' down_proj"] = expert
        if arch.moe.shared_expert_intermediate_size:
            rows["shared_expert gate_proj / up_proj"] = arch.moe.shared_expert_intermediate_size // size
            columns["shared_expert down_proj"] = arch.moe.shared_expert_intermediate_size // size
    if spec.scheme == "fp8_w8a8":
        if spec.fp8_weight_strategy != "block" or not spec.from_checkpoint:
            return None
        assert spec.fp8_block is not None
        row_align, column_align = spec.fp8_block
    else:
        # 4-bit values packed 8 to a word along N: AWQ's qweight, AWQ / GPTQ qzeros, compressed-tensors'
        # asymmetric weight_zero_point (its symmetric checkpoints pack along K only).
        packs_rows = spec.int4_format != "pack-quantized" or spec.zero_point
        row_align = 8 if spec.from_checkpoint and packs_rows else 1
        if spec.group_size == -1:
            if not spec.from_checkpoint:
                return (
                    f"{what}: per-channel 4-bit scales quantized at load would differ per shard of a row-parallel "
                    "layer; use a group size (e.g. 128) or tensor_parallel_size=1"
                )
            column_align = 8
        else:
            # GPTQ and compressed-tensors pack 8 input columns to a word; groups of columns hold their
            # zeros / scales.
            column_align = math.lcm(spec.group_size, 8) if spec.from_checkpoint else spec.group_size
    bad = [f"{name} {n} output rows (blocks of {row_align})" for name, n in rows.items() if n % row_align]
    bad += [f"{name} {n} input columns (blocks of {column_align})" for name, n in columns.items() if n % column_align]
    if bad:
        return (
            f"{what} cannot be split over {size} ranks: each rank's shard must hold whole blocks / groups, and "
            f"it would hold {', '.join(bad)}; choose another tensor_parallel_size or use tensor_parallel_size=1"
        )
    return None


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
    UnsupportedModelError naming what tokenmill cannot run (method, bits, group size, scheme)."""
    spec = checkpoint_quantization(hf_config, source)
    return None if spec is None else spec.method


def resolve_quantization(
    hf_config: dict | None, requested: str | None, source: str, *, dummy: bool = False
) -> QuantizationSpec | None:
    """The spec a model loads with: its checkpoint's (which `requested` must agree with), else
    `requested` applied at load, else None. `hf_config` is None for GGUF files; `dummy` weights are
    random 16-bit ones, quantized at load in the checkpoint's (or the requested) scheme."""
    if requested is not None and requested not in QUANTIZATION_METHODS:
        raise UnsupportedModelError(
            f"quantization={requested!r} is not a method tokenmill runs; choose one of "
            f"{', '.join(QUANTIZATION_METHODS)}",
            param="quantization",
        )
    checkpoint = checkpoint_quantization(hf_config, source) if hf_config is not None else None
    if checkpoint is not None:
        if requested is not None and requested != checkpoint.method:
            raise UnsupportedModelError(
                f"quantization={requested!r}, but {source} is a {checkpoint.method!r} checkpoint; leave "
                f"--quantization unset or pass {checkpoint.method!r}",
                param="quantization",
            )
        if dummy:
            return _replace_source(checkpoint)
        return checkpoint
    if requested is None:
        return None
    if requested == "compressed-tensors":
        raise UnsupportedModelError(
            f"quantization='compressed-tensors' needs a compressed-tensors checkpoint, and {source} is "
            "not quantized; to quantize 16-bit weights at load use --quantization fp8, awq or gptq",
            param="quantization",
        )
    return at_load_quantization(requested)


def at_load_quantization(method: str) -> QuantizationSpec:
    """The scheme `--quantization METHOD` quantizes 16-bit weights into at load."""
    if method == "fp8":
        return QuantizationSpec(method="fp8", scheme="fp8_w8a8", from_checkpoint=False)
    if method == "awq":
        return QuantizationSpec(method="awq", scheme="int4_w4a16", from_checkpoint=False, int4_format="awq")
    if method == "gptq":
        return QuantizationSpec(
            method="gptq", scheme="int4_w4a16", from_checkpoint=False, int4_format="gptq", zero_point=False
        )
    raise UnsupportedModelError(f"no at-load quantization for {method!r}", param="quantization")


def _replace_source(spec: QuantizationSpec) -> QuantizationSpec:
    """Dummy weights of a quantized checkpoint's config: quantized at load in its scheme (FP8 at
    the checkpoint's block size if it has one)."""
    from dataclasses import replace

    return replace(spec, from_checkpoint=False, act_order=False, kv_cache_scales=False)


def checkpoint_quantization(hf_config: dict, source: str) -> QuantizationSpec | None:
    """Parse `hf_config["quantization_config"]` (None: not quantized)."""
    method = quantization_method(hf_config)
    if method is None:
        return None
    quant = hf_config["quantization_config"]
    parse = _PARSERS.get(method)
    if parse is None:
        raise UnsupportedModelError(
            f"{source} is a quantized checkpoint (quantization_config.quant_method = {method!r}), and tokenmill "
            f"cannot run {method!r} weights; supported quantization methods: {', '.join(QUANTIZATION_METHODS)}. "
            "Load the model's unquantized (16-bit) checkpoint instead, or a GGUF file of it",
            param="model",
        )
    return parse(quant, _Refusal(source, method))


class _Refusal:
    """Builds the UnsupportedModelError for one checkpoint's config."""

    def __init__(self, source: str, method: str) -> None:
        self.source, self.method = source, method

    def __call__(self, what: str, supported: str) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"{self.source}: {self.method} checkpoint with {what}, which tokenmill cannot run; supported: "
            f"{supported}",
            param="model",
        )


def _ignore_list(quant: dict, *keys: str) -> tuple[str, ...]:
    names: list[str] = []
    for key in keys:
        value = quant.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UnsupportedModelError(f"quantization_config.{key} must be a list of module names, got {value!r}")
        names.extend(value)
    return tuple(names)


def _parse_hf_fp8(quant: dict, refuse: _Refusal) -> QuantizationSpec:
    """transformers' `fp8` (FineGrainedFP8, DeepSeek style): e4m3 weights with `weight_scale_inv`
    per 128x128 block; without `weight_block_size`, per-tensor `weight_scale` (vLLM's fp8 format)."""
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise refuse(f"fmt={fmt!r}", "fmt 'e4m3'")
    activation = quant.get("activation_scheme", "dynamic")
    if activation not in ("dynamic", "static"):
        raise refuse(f"activation_scheme={activation!r}", "'dynamic' or 'static'")
    block = quant.get("weight_block_size")
    ignore = _ignore_list(quant, "modules_to_not_convert", "ignored_layers")
    if block is None:
        return QuantizationSpec(
            method="fp8", scheme="fp8_w8a8", from_checkpoint=True, fp8_weight_strategy="tensor",
            fp8_static_input_scales=activation == "static", ignore=ignore,
        )  # fmt: skip
    if list(block) != list(FP8_BLOCK):
        raise refuse(f"weight_block_size={block!r}", f"{list(FP8_BLOCK)}")
    if activation != "dynamic":
        raise refuse("static activation scales with block-scaled weights", "activation_scheme 'dynamic'")
    return QuantizationSpec(
        method="fp8", scheme="fp8_w8a8", from_checkpoint=True, fp8_weight_strategy="block",
        fp8_block=FP8_BLOCK, fp8_scale_name="weight_scale_inv", ignore=ignore,
    )  # fmt: skip


def _check_int4(bits: object, group_size: object, refuse: _Refusal) -> int:
    if bits != 4:
        raise refuse(f"bits={bits!r}", "bits 4")
    if group_size not in INT4_GROUP_SIZES:
        raise refuse(f"group_size={group_size!r}", f"group_size one of {', '.join(map(str, INT4_GROUP_SIZES))}")
    assert isinstance(group_size, int)
    return group_size


def _parse_awq(quant: dict, refuse: _Refusal) -> QuantizationSpec:
    bits = quant.get("bits", quant.get("w_bit"))
    group_size = _check_int4(bits, quant.get("group_size", quant.get("q_group_size")), refuse)
    version = str(quant.get("version", "gemm")).lower()
    if version != "gemm":
        raise refuse(f"version={version!r} (its packing)", "version 'gemm'")
    if not quant.get("zero_point", True):
        raise refuse("zero_point false", "zero_point true (AWQ's own layout)")
    return QuantizationSpec(
        method="awq", scheme="int4_w4a16", from_checkpoint=True, int4_format="awq", group_size=group_size,
        zero_point=True, ignore=_ignore_list(quant, "modules_to_not_convert"),
    )  # fmt: skip


def _parse_gptq(quant: dict, refuse: _Refusal) -> QuantizationSpec:
    group_size = _check_int4(quant.get("bits"), quant.get("group_size"), refuse)
    if quant.get("lm_head"):
        raise refuse("a quantized lm_head (lm_head: true)", "lm_head false")
    if quant.get("dynamic"):
        raise refuse("per-module overrides (dynamic)", "one scheme for every layer")
    checkpoint_format = str(quant.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise refuse(f"checkpoint_format={checkpoint_format!r}", "'gptq' or 'gptq_v2'")
    return QuantizationSpec(
        method="gptq", scheme="int4_w4a16", from_checkpoint=True, int4_format="gptq", group_size=group_size,
        zero_point=not bool(quant.get("sym", True)), act_order=bool(quant.get("desc_act", False)),
        gptq_zeros_offset=1 if checkpoint_format == "gptq" else 0,
        ignore=_ignore_list(quant, "modules_to_not_convert"),
    )  # fmt: skip


CT_FP8_FORMATS = ("float-quantized", "naive-quantized")
CT_INT4_FORMAT = "pack-quantized"
CT_INT4_GROUP_SIZES = (32, 64, 128)  # strategy "group"; strategy "channel" is one group (-1)
_CT_FORMATS = "format 'float-quantized' (FP8 weights) or 'pack-quantized' (4-bit integer weights, W4A16)"


def _parse_compressed_tensors(quant: dict, refuse: _Refusal) -> QuantizationSpec:
    """llm-compressor's checkpoints: FP8 (`format: float-quantized`): e4m3 weights with a per-tensor,
    per-channel or 128x128-block `weight_scale`; activations dynamic per token (or per 1x128 group
    for blocks), or static per tensor (`input_scale`). W4A16 (`format: pack-quantized`): 4-bit
    integer weights in groups of 32 / 64 / 128 or per channel, symmetric or with zero points, in
    input-column order or act-order ("group"); 16-bit activations."""
    top = quant.get("format", "float-quantized")
    if top not in (*CT_FP8_FORMATS, CT_INT4_FORMAT, "mixed-precision"):
        raise refuse(f"format={top!r}", _CT_FORMATS)
    groups = quant.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise refuse(f"format {top!r} without config_groups", "one config group of FP8 or of 4-bit integer weights")
    # A config group may name its own format (compressed-tensors writes "mixed-precision" at the top
    # when they differ); one format for every layer is what we run.
    formats = {group.get("format") or top for group in groups.values()}
    if len(formats) != 1:
        raise refuse(f"config groups of different formats ({', '.join(sorted(formats))})", "one format for every Linear layer")
    fmt = formats.pop()
    if fmt not in (*CT_FP8_FORMATS, CT_INT4_FORMAT):
        raise refuse(f"format={fmt!r}", _CT_FORMATS)
    kv = quant.get("kv_cache_scheme")
    if kv is not None and (kv.get("type"), kv.get("num_bits")) != ("float", 8):
        raise refuse(f"kv_cache_scheme={kv!r}", "an FP8 (float, 8 bits) kv_cache_scheme")
    if fmt == CT_INT4_FORMAT:
        int4_schemes = {_ct_int4_scheme(group, refuse) for group in groups.values()}
        if len(int4_schemes) != 1:
            raise refuse("config groups of different schemes", "one scheme for every Linear layer")
        group_size, symmetric, act_order = int4_schemes.pop()
        return QuantizationSpec(
            method="compressed-tensors", scheme="int4_w4a16", from_checkpoint=True, int4_format="pack-quantized",
            group_size=group_size, zero_point=not symmetric, act_order=act_order,
            ignore=_ignore_list(quant, "ignore"), kv_cache_scales=kv is not None,
        )  # fmt: skip
    schemes = {_ct_scheme(group, refuse) for group in groups.values()}
    if len(schemes) != 1:
        raise refuse("config groups of different schemes", "one scheme for every Linear layer")
    strategy, static_input = schemes.pop()
    return QuantizationSpec(
        method="compressed-tensors", scheme="fp8_w8a8", from_checkpoint=True, fp8_weight_strategy=strategy,
        fp8_block=FP8_BLOCK if strategy == "block" else None, fp8_static_input_scales=static_input,
        ignore=_ignore_list(quant, "ignore"), kv_cache_scales=kv is not None,
    )  # fmt: skip


def _ct_targets(group: dict, refuse: _Refusal) -> None:
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise refuse(f"targets={targets!r}", "targets ['Linear']")


def _ct_scheme(group: dict, refuse: _Refusal) -> tuple[Fp8WeightStrategy, bool]:
    """(weight strategy, static input scales) of one compressed-tensors FP8 config group."""
    _ct_targets(group, refuse)
    weights = group.get("weights") or {}
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8):
        raise refuse(
            f"weights of type {weights.get('type')!r} with {weights.get('num_bits')!r} bits in an FP8 format",
            "FP8 weights (float, 8 bits); 4-bit integer weights come as format 'pack-quantized'",
        )
    if weights.get("dynamic") or not weights.get("symmetric", True):
        raise refuse("dynamic or asymmetric weight scales", "static symmetric weight scales")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise refuse(f"weight strategy {strategy!r}", "tensor, channel or block")
    if strategy == "block" and list(weights.get("block_structure") or []) != list(FP8_BLOCK):
        raise refuse(f"block_structure={weights.get('block_structure')!r}", f"{list(FP8_BLOCK)}")
    acts = group.get("input_activations")
    if acts is None:
        return strategy, False  # FP8 weights, 16-bit activations: we quantize activations per token anyway
    if (acts.get("type"), acts.get("num_bits")) != ("float", 8):
        raise refuse(f"input activations {acts!r}", "FP8 activations or none")
    act_strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic"))
    if dynamic and act_strategy in ("token", "group"):
        return strategy, False
    if not dynamic and act_strategy == "tensor":
        return strategy, True
    raise refuse(
        f"input activation strategy {act_strategy!r} (dynamic={dynamic})",
        "dynamic per-token or per-group, or static per-tensor",
    )


def _ct_int4_scheme(group: dict, refuse: _Refusal) -> tuple[int, bool, bool]:
    """(group size, -1 per channel; symmetric; act-order) of one compressed-tensors `pack-quantized`
    config group."""
    _ct_targets(group, refuse)
    weights = group.get("weights") or {}
    kind, bits = weights.get("type", "int"), weights.get("num_bits")
    if kind != "int":
        raise refuse(f"pack-quantized weights of type {kind!r}", "type 'int' (4-bit integer weights)")
    if bits != 4:
        raise refuse(f"pack-quantized weights of num_bits={bits!r}", "num_bits 4")
    if weights.get("dynamic"):
        raise refuse(f"dynamic weight scales (dynamic={weights.get('dynamic')!r})", "static weight scales (dynamic false)")
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    if strategy is None and isinstance(group_size, int):  # inferred as compressed-tensors' own model does
        strategy = "group" if group_size > 0 else "channel" if group_size == -1 else None
    if strategy == "group":
        if group_size not in CT_INT4_GROUP_SIZES:
            raise refuse(
                f"group_size={group_size!r}",
                f"strategy 'group' with group_size {', '.join(map(str, CT_INT4_GROUP_SIZES))}, or strategy 'channel'",
            )
    elif strategy == "channel":
        group_size = -1
    else:
        raise refuse(
            f"4-bit weight strategy {strategy!r}",
            f"strategy 'group' (group_size {', '.join(map(str, CT_INT4_GROUP_SIZES))}) or 'channel'",
        )
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise refuse(f"symmetric={symmetric!r}", "symmetric true or false")
    for acts in ("input_activations", "output_activations"):
        if group.get(acts) is not None:
            raise refuse(
                f"quantized {acts} ({group[acts]!r})",
                f"{acts} null (W4A16: 4-bit weights, 16-bit activations)",
            )
    return group_size, symmetric, _ct_actorder(weights.get("actorder"), refuse)


def _ct_actorder(actorder: object, refuse: _Refusal) -> bool:
    """Whether a pack-quantized checkpoint's `actorder` stores a permuted weight_g_idx: "group" (older
    compressed-tensors: "dynamic" or true) does; "weight" ("static") only changed the order GPTQ
    calibrated in, and the groups are in input-column order as without actorder."""
    if actorder in (None, False, "weight", "static"):
        return False
    if actorder in (True, "group", "dynamic"):
        return True
    raise refuse(f"actorder={actorder!r}", "actorder null, 'weight' (or 'static') or 'group' (or 'dynamic')")


_PARSERS = {
    "fp8": _parse_hf_fp8,
    "awq": _parse_awq,
    "gptq": _parse_gptq,
    "compressed-tensors": _parse_compressed_tensors,
}
