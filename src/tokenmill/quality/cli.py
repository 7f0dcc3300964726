"""`tokenmill quality-gate MODEL [--quantization METHOD] [--base BASE] [thresholds...]`, and the
same gate flags for `tokenmill serve --quality-gate` (there with a `--quality-gate-` prefix).

Exit status: 0 when every metric is within its threshold, 1 when one is past it (the table names
it), 2 when the gate could not run (bad flags, a model that does not load).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from tokenmill.args import EngineArgs
from tokenmill.errors import TokenmillError
from tokenmill.quality.text_set import TextSetOptions
from tokenmill.quality.verdict import Thresholds

logger = logging.getLogger(__name__)

_THRESHOLD_HELP = {
    "max_perplexity_ratio": "fail when the candidate's perplexity over the base's is above this",
    "max_mean_kl": "fail when the mean KL(base || candidate) of the next-token distributions, in nats, "
    "is above this",
    "min_top1_agreement": "fail when the fraction of positions with the same most likely token is below this",
    "min_greedy_agreement": "fail when the mean fraction of greedy tokens equal before the first divergence "
    "is below this",
}
_OPTION_HELP = {
    "window": "tokens per scored window of the text set",
    "max_windows": "score only the first N windows; they take turns over prose, code and lists",
    "greedy_prompts": "prompts continued greedily by both models (0: skip the greedy metric)",
    "greedy_prompt_tokens": "tokens of each greedy prompt",
    "greedy_tokens": "tokens generated from each greedy prompt",
}


def _dest(prefix: str, name: str) -> str:
    return prefix.replace("-", "_") + name


def add_gate_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """--base, the thresholds and the text-set options, each flag named `--{prefix}{name}`."""
    group = parser.add_argument_group("quality gate")
    group.add_argument(
        f"--{prefix}base",
        dest=_dest(prefix, "base"),
        default=None,
        help="the model to compare against (default: the model itself without --quantization / "
        "--kv-cache-dtype; required for a quantized checkpoint)",
    )
    for f in dataclasses.fields(Thresholds):
        group.add_argument(
            f"--{prefix}{f.name.replace('_', '-')}",
            dest=_dest(prefix, f.name),
            type=float,
            default=f.default,
            help=f"{_THRESHOLD_HELP[f.name]} (default: {f.default:g})",
        )
    for f in dataclasses.fields(TextSetOptions):
        group.add_argument(
            f"--{prefix}{f.name.replace('_', '-')}",
            dest=_dest(prefix, f.name),
            type=int,
            default=f.default,
            help=f"{_OPTION_HELP[f.name]} (default: {'all' if f.default is None else f.default})",
        )


def gate_settings(
    args: argparse.Namespace, prefix: str = ""
) -> tuple[str | None, TextSetOptions, Thresholds]:
    """(base model, text-set options, thresholds) from the flags `add_gate_args` declared."""
    options = TextSetOptions(
        **{f.name: getattr(args, _dest(prefix, f.name)) for f in dataclasses.fields(TextSetOptions)}
    )
    thresholds = Thresholds(
        **{f.name: getattr(args, _dest(prefix, f.name)) for f in dataclasses.fields(Thresholds)}
    )
    return getattr(args, _dest(prefix, "base")), options, thresholds


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="the model to test (same as --model)")
    EngineArgs.add_cli_args(parser)
    add_gate_args(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")


def engine_args_of(args: argparse.Namespace) -> EngineArgs:
    """The engine options of the command line, with MODEL or --model (given once) as the model."""
    engine_args = EngineArgs.from_cli_args(args)
    model_tag = getattr(args, "model_tag", None)
    if model_tag is not None:
        if engine_args.model is not None and engine_args.model != model_tag:
            raise ValueError(
                f"the model is given twice, {model_tag!r} and --model {engine_args.model!r}; give it once"
            )
        engine_args = dataclasses.replace(engine_args, model=model_tag)
    return engine_args


def main(args: argparse.Namespace) -> int:
    from tokenmill.quality.gate import plan_gate, run_gate
    from tokenmill.quality.table import format_json, format_table

    try:
        base, options, thresholds = gate_settings(args)
        options.check()
        thresholds.check()
        plan = plan_gate(engine_args_of(args), base)
        report = run_gate(plan, options, thresholds)
    except (ValueError, OSError, TokenmillError) as exc:  # what the user can fix: the message says how
        print(f"tokenmill quality-gate: error: {exc}", file=sys.stderr)
        return 2
    except Exception:
        # Anything else is a fault of ours or of the model's code: its traceback, and not exit
        # status 1, which says "measured and failed".
        logger.exception("the quality gate could not run")
        return 2
    print(format_json(report) if args.json else format_table(report))
    return 0 if report.passed else 1
