"""The quality gate from end to end: which two engines are compared, measuring them one after the
other, and the report (metrics, thresholds, verdict) that the table and `--json` print.

The candidate is the model with the engine options given (`--quantization fp8`, `--kv-cache-dtype
fp8`, ...); the base is `--base BASE` or, without it, the same model with those lossy options back
at their defaults. A quantized checkpoint has no unquantized weights to fall back on, so for one
`--base` is required.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, fields
from typing import Any

from tokenmill.args import EngineArgs
from tokenmill.quality.metrics import GateMetrics
from tokenmill.quality.text_set import TextSet, TextSetOptions, build_text_set
from tokenmill.quality.verdict import Thresholds, Verdict, judge

logger = logging.getLogger(__name__)

# Engine options that trade accuracy for memory or speed: the base has them at their defaults.
LOSSY_OPTIONS = ("quantization", "kv_cache_dtype")
# Options shown next to a model's name in the report, when not at their defaults.
DESCRIBED_OPTIONS = (*LOSSY_OPTIONS, "revision", "dtype", "load_format", "device")


@dataclass(frozen=True, slots=True)
class GatePlan:
    candidate: EngineArgs
    base: EngineArgs


def _defaults_of(names: tuple[str, ...]) -> dict[str, Any]:
    """The EngineArgs defaults of those of `names` that are engine options."""
    return {f.name: f.default for f in fields(EngineArgs) if f.name in names}


def plan_gate(candidate: EngineArgs, base_model: str | None = None) -> GatePlan:
    """The two engines to compare. Raises ValueError when there is nothing to compare, or when
    the base would be a quantized checkpoint's own quantized weights."""
    unquantized = _defaults_of(LOSSY_OPTIONS)
    if base_model is not None:
        # Another model: its own revision and weight format, the candidate's device, dtype and sizes.
        base = dataclasses.replace(
            candidate, model=base_model, revision=None, load_format="auto", **unquantized
        )
        return GatePlan(candidate, base)
    method = checkpoint_quantization(candidate)
    if method is not None:
        raise ValueError(
            f"{candidate.model} is a quantized checkpoint ({method}); it holds no unquantized weights to "
            "compare against: pass --base with the 16-bit model it was quantized from"
        )
    base = dataclasses.replace(candidate, **unquantized)
    if base == candidate:
        raise ValueError(
            "nothing to compare: the candidate has no lossy option set, so the base would be the very "
            f"same engine; give --quantization METHOD (or --kv-cache-dtype fp8) to test it against "
            f"{candidate.model or 'the default model'}, or --base BASE_MODEL to compare two models"
        )
    return GatePlan(candidate, base)


def checkpoint_quantization(args: EngineArgs) -> str | None:
    """How the model's checkpoint itself is quantized ("awq: INT4 W4A16 (...)"), None if it holds
    float weights (GGUF files included: their weights load as floats, which is the base a
    `--quantization` is measured against)."""
    from tokenmill.config import ModelConfig
    from tokenmill.model.resolve import resolve_model

    resolved = resolve_model(
        ModelConfig(
            model=args.model, revision=args.revision, download_dir=args.download_dir,
            load_format=args.load_format,  # type: ignore[arg-type]
        )
    )  # fmt: skip
    # With no --quantization asked for, a spec can only come from the checkpoint's config.
    return resolved.quantization.describe() if resolved.quantization is not None else None


def describe(args: EngineArgs) -> str:
    """'SmolLM2-135M-Instruct (quantization=fp8)': the model and its options that matter here."""
    from tokenmill.model.loader.default_model import DEFAULT_MODEL_NAME

    defaults = _defaults_of(DESCRIBED_OPTIONS)
    shown = [f"{name}={getattr(args, name)}" for name in defaults if getattr(args, name) != defaults[name]]
    name = args.model or DEFAULT_MODEL_NAME
    return f"{name} ({', '.join(shown)})" if shown else name


@dataclass(frozen=True, slots=True)
class GateReport:
    candidate: str
    base: str
    options: TextSetOptions
    thresholds: Thresholds
    metrics: GateMetrics
    seconds: float

    @property
    def verdict(self) -> Verdict:
        return judge(self.metrics, self.thresholds)

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate,
            "base": self.base,
            "text_set": dataclasses.asdict(self.options),
            "thresholds": dataclasses.asdict(self.thresholds),
            "metrics": self.metrics.to_dict(),
            "seconds": self.seconds,
            **self.verdict.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateReport:
        return cls(
            candidate=data["candidate"],
            base=data["base"],
            options=TextSetOptions(**data["text_set"]),
            thresholds=Thresholds(**data["thresholds"]),
            metrics=GateMetrics.from_dict(data["metrics"]),
            seconds=data["seconds"],
        )


def _load(args: EngineArgs, role: str):
    from tokenmill.engine.llm import LLM

    logger.info("quality gate: loading the %s model, %s", role, describe(args))
    llm = LLM(**args.as_kwargs())
    if llm.get_tokenizer() is None:
        raise ValueError(f"the {role} model {describe(args)} has no tokenizer; the quality gate needs one")
    return llm


def _release(llm) -> None:
    # close() frees the KV pool and weights now (no reference cycle keeps them: see LLM.close).
    llm.close()


def measure_base(base: EngineArgs, options: TextSetOptions):
    """(the text set, tokenized with the base's tokenizer; the base's Reference). The base model
    is released before this returns."""
    from tokenmill.quality.measure import score_base

    llm = _load(base, "base")
    try:
        text_set = build_text_set(llm.get_tokenizer(), options)
        logger.info(
            "quality gate: %d windows of up to %d tokens (%d scored positions), "
            "%d greedy prompts x %d tokens",
            len(text_set.windows), options.window, text_set.num_scored_tokens, len(text_set.greedy_prompts),
            text_set.greedy_tokens,
        )  # fmt: skip
        reference = score_base(llm, text_set)
    finally:
        _release(llm)
    return text_set, reference


def measure_candidate(
    candidate: EngineArgs, text_set: TextSet, reference, options: TextSetOptions
) -> GateMetrics:
    """The candidate scored against the base's Reference; the candidate is released before this
    returns."""
    from tokenmill.quality.measure import score_candidate

    llm = _load(candidate, "candidate")
    try:
        if build_text_set(llm.get_tokenizer(), options) != text_set:
            raise ValueError(
                f"the candidate {describe(candidate)} tokenizes the text set differently from the base: "
                "the two models must share a tokenizer to be compared"
            )
        return score_candidate(llm, text_set, reference)
    finally:
        _release(llm)


def run_gate(plan: GatePlan, options: TextSetOptions, thresholds: Thresholds) -> GateReport:
    options.check()
    thresholds.check()
    started = time.perf_counter()
    text_set, reference = measure_base(plan.base, options)
    metrics = measure_candidate(plan.candidate, text_set, reference, options)
    return GateReport(
        candidate=describe(plan.candidate),
        base=describe(plan.base),
        options=options,
        thresholds=thresholds,
        metrics=metrics,
        seconds=time.perf_counter() - started,
    )
