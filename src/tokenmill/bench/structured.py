"""The structured-output workload's requests: a prompt asking for a JSON object, its schema, and the
check of each reply against that schema.

Constraints are sent in vLLM's `structured_outputs` field (`{"json": schema,
"disable_any_whitespace": true}`) or OpenAI's `response_format` (`json_schema`, strict).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenmill.bench.datasets import SampleRequest
from tokenmill.bench.json_schemas import SCHEMAS, SchemaCase

CONSTRAINT_FIELDS = ("structured_outputs", "response_format")

# The engine's metric names (histograms in seconds); one place to adjust them when the engine's land.
COMPILE_METRIC = "tokenmill:structured_output_compile_seconds"
MASK_METRIC = "tokenmill:structured_output_mask_seconds"


# Walks of every shipped schema's xgrammar matcher (SmolLM2's tokenizer, no whitespace) took 35-152
# tokens choosing uniformly among the allowed tokens, as random weights do, and at most 379 always
# choosing a one-character token: 512 leaves room for tokenizers that split text finer.
DEFAULT_OUTPUT_LEN = 512


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output (--dataset-name json-schema)")
    group.add_argument(
        "--structured-output-len",
        type=int,
        default=DEFAULT_OUTPUT_LEN,
        help="max_tokens of both phases; the default covers the longest shipped schema's reply",
    )
    group.add_argument(
        "--structured-input-len",
        type=int,
        default=0,
        help="prompt tokens: 0 sends the text prompt; N sends N token ids (random filler, then the text)",
    )
    group.add_argument(
        "--structured-output-field",
        choices=("structured_outputs", "response_format"),
        default="structured_outputs",
        help="how the schema is sent: vLLM's structured_outputs.json or OpenAI's response_format json_schema",
    )
    group.add_argument(
        "--structured-any-whitespace",
        action="store_true",
        help="let the grammar allow any whitespace (default: disable_any_whitespace true)",
    )


@dataclass(slots=True)
class StructuredRequest:
    request: SampleRequest
    case: SchemaCase


def prompt_text(case: SchemaCase) -> str:
    schema = json.dumps(case.schema, separators=(",", ":"))
    return f"{case.task} Reply with only a JSON object that matches this JSON Schema:\n{schema}\n"


def fit_to_length(ids: list[int], length: int, pool: Sequence[int], rng: np.random.Generator) -> list[int]:
    """Exactly `length` ids: random pool ids before the text's, or the text's last ids when it is longer.

    The filler goes first so the request (task and schema) stays at the end, next to the reply.
    """
    if length <= len(ids):
        return ids[len(ids) - length :]
    filler = rng.choice(np.asarray(pool), size=length - len(ids)).tolist()
    return filler + ids


def structured_requests(
    num_prompts: int, output_len: int, rng: np.random.Generator, cases: Sequence[SchemaCase] = SCHEMAS
) -> list[StructuredRequest]:
    """`num_prompts` text requests cycling through every schema (each used equally often), shuffled."""
    if not cases:
        raise ValueError("no schemas to build structured-output requests from")
    order = rng.permutation(num_prompts)
    requests = []
    for i in order:
        case = cases[int(i) % len(cases)]
        text = prompt_text(case)
        # prompt_len is a placeholder until the server's usage says how many tokens the text was.
        requests.append(StructuredRequest(SampleRequest(text, 0, output_len), case))
    return requests


def constraint_body(case: SchemaCase, field: str, any_whitespace: bool) -> dict[str, Any]:
    """The request fields that constrain the reply to `case.schema`."""
    if field == "structured_outputs":
        return {"structured_outputs": {"json": case.schema, "disable_any_whitespace": not any_whitespace}}
    if field == "response_format":
        spec = {"name": case.name, "schema": case.schema, "strict": True}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    raise ValueError(f"constraint field must be one of {', '.join(CONSTRAINT_FIELDS)}, got {field!r}")


def check_output(text: str, finish_reason: str | None, schema: dict[str, Any]) -> str | None:
    """Why a reply is not a valid instance of `schema` (a short reason), or None when it is.

    A reply cut at max_tokens is invalid even if its prefix parses. JSON is parsed strictly, as a
    client would: raw control characters inside strings are an error.
    """
    # Imported here: `bench serve`'s other datasets need no jsonschema on the load generator's host.
    import jsonschema

    if finish_reason == "length":
        return "finish_reason length"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as exc:
        return f"schema: {exc.validator} at /{'/'.join(map(str, exc.absolute_path))}"
    return None
