"""The `copy-heavy` dataset of `bench serve`: chat prompts whose answer mostly repeats the prompt.

Each prompt asks to rewrite, edit or extract from a text given in it: rename a variable in Python
code, replace a name in a story, extract fields from JSON records, turn CSV into a Markdown table,
copy the error lines of a log. Answers like these reuse long runs of the prompt's tokens, which is
where prompt-lookup (n-gram) speculation pays. The texts are generated here from small word lists
and a seed (no downloads): the same seed and tokenizer give the same prompts.

A prompt is an instruction plus some number of items (code lines, sentences, records, rows, log
lines); that number is chosen, by bisection on the tokenizer's counts, so the text's length lands
near a length drawn uniformly in [min, max] tokens (the chat template adds its few tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Awaitable, Callable

from tokenmill.bench.datasets import SampleRequest

DEFAULT_MIN_INPUT_LEN = 128
DEFAULT_MAX_INPUT_LEN = 512
DEFAULT_OUTPUT_LEN = 128
MAX_ITEMS = 200  # more items than any prompt of 512 tokens holds

FIRST_NAMES = (
    "Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ingrid", "Jonas",
    "Keiko", "Luca", "Maya", "Nadia", "Oscar", "Priya", "Quentin", "Rosa", "Samir", "Tara",
)  # fmt: skip
LAST_NAMES = (
    "Andersen", "Baker", "Costa", "Dubois", "Evans", "Fischer", "Garcia", "Hughes", "Ivanova",
    "Jensen", "Kowalski", "Lopez", "Moreau", "Novak", "Okafor", "Petrov", "Rossi", "Schmidt",
)  # fmt: skip
CITIES = (
    "Lisbon", "Oslo", "Nairobi", "Osaka", "Lyon", "Denver", "Porto", "Krakow", "Dublin", "Seville",
    "Turin", "Leeds", "Quebec", "Bergen", "Perth", "Austin",
)  # fmt: skip
ROLES = ("engineer", "designer", "analyst", "manager", "writer", "researcher", "tester", "support")
NOUNS = (
    "report", "garden", "bicycle", "letter", "budget", "kitchen", "map", "camera", "ticket", "recipe",
    "window", "notebook", "harbor", "bridge", "meeting", "library", "festival", "train", "market",
)  # fmt: skip
VERBS = (
    "checked", "painted", "repaired", "found", "described", "carried", "reviewed", "cleaned",
    "measured", "planned", "opened", "photographed", "visited", "organized", "returned",
)  # fmt: skip
TIMES = (
    "on Monday morning", "after lunch", "before the storm", "late in the evening", "at dawn",
    "during the holidays", "last spring", "on a rainy afternoon", "the next day", "at noon",
)  # fmt: skip
ADJECTIVES = ("old", "quiet", "bright", "narrow", "heavy", "small", "famous", "broken", "new", "green")
IDENTIFIERS = (
    "count", "total", "index", "offset", "buffer", "value", "limit", "score", "weight", "price",
    "width", "height", "delta", "ratio", "cursor", "batch", "record", "result", "item", "node",
)  # fmt: skip
PRODUCTS = (
    "desk lamp", "water bottle", "notebook", "backpack", "headphones", "coffee mug", "keyboard",
    "umbrella", "phone case", "desk chair", "travel pillow", "wall clock", "tea kettle", "monitor",
)  # fmt: skip
SERVICES = ("auth", "billing", "search", "gateway", "storage", "scheduler", "mailer", "cache")
LOG_MESSAGES = (
    "request completed in {n} ms",
    "connection to {svc} lost, retrying in {m} s",
    "user {id} logged in from {city}",
    "cache miss for key session:{id}",
    "payment {id} declined: insufficient funds",
    "disk usage at {m}% on volume data-{m}",
    "timeout after {n} ms calling {svc}",
    "job {id} finished with {m} warnings",
)


def _rename_code(rng: random.Random, num_items: int) -> str:
    """A Python module of `num_items` body lines, in functions of up to 6 lines each."""
    old, new, *others = rng.sample(IDENTIFIERS, 6)
    lines: list[str] = []
    for i in range(num_items):
        if i % 6 == 0:
            lines += ["", f"def {rng.choice(VERBS)}_{rng.choice(NOUNS)}({old}, {others[0]}):"]
        a, b = rng.sample(others, 2)
        n = rng.randint(2, 99)
        lines.append(
            rng.choice(
                (
                    f"    {old} = {old} + {a} * {n}",
                    f"    if {old} > {n}:\n        {b} = {old} - {a}",
                    f"    {a} = min({old}, {b} + {n})",
                    f"    for {b} in range({old}):\n        {a} += {b} % {n}",
                    f"    print(f\"{old}={{{old}}}, {a}={{{a}}}\")",
                    f"    {old} = max({old} // {n}, {a})",
                )
            )
        )
        if i % 6 == 5 or i == num_items - 1:
            lines.append(f"    return {old}")
    code = "\n".join(lines).strip("\n")
    return (
        f"Rename the variable `{old}` to `{new}` everywhere in the Python code below. Keep everything "
        f"else exactly as it is and reply with the complete code only.\n\n```python\n{code}\n```"
    )


def _replace_name(rng: random.Random, num_items: int) -> str:
    """A story of `num_items` sentences about one person, whose name is to be replaced."""
    old, new = rng.sample(FIRST_NAMES, 2)
    friends = [f for f in FIRST_NAMES if f not in (old, new)]
    sentences = []
    for _ in range(num_items):
        sentences.append(
            rng.choice(
                (
                    f"{old} {rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} "
                    f"{rng.choice(TIMES)}.",
                    f"{rng.choice(TIMES).capitalize()}, {rng.choice(friends)} asked {old} about the "
                    f"{rng.choice(NOUNS)} in {rng.choice(CITIES)}.",
                    f"Nobody in {rng.choice(CITIES)} knew why {old} {rng.choice(VERBS)} the "
                    f"{rng.choice(NOUNS)}.",
                    f"{old} and {rng.choice(friends)} {rng.choice(VERBS)} a {rng.choice(ADJECTIVES)} "
                    f"{rng.choice(NOUNS)} together.",
                )
            )
        )
    return (
        f"Rewrite the text below, replacing the name {old} with {new} everywhere. Change nothing "
        f"else.\n\n{' '.join(sentences)}"
    )


def _extract_json(rng: random.Random, num_items: int) -> str:
    """A JSON array of `num_items` people records, of which the name and email are to be kept."""
    records = []
    for i in range(num_items):
        first, last = rng.choice(FIRST_NAMES), rng.choice(LAST_NAMES)
        records.append(
            f'  {{"id": {1000 + 7 * i + rng.randint(0, 6)}, "name": "{first} {last}", '
            f'"email": "{first.lower()}.{last.lower()}@example.com", "city": "{rng.choice(CITIES)}", '
            f'"role": "{rng.choice(ROLES)}", "active": {rng.choice(("true", "false"))}}}'
        )
    body = ",\n".join(records)
    return (
        "Extract the name and email of every record in the JSON below. Reply with a JSON array of "
        f'objects with exactly the keys "name" and "email", in the same order.\n\n[\n{body}\n]'
    )


def _csv_to_markdown(rng: random.Random, num_items: int) -> str:
    """A CSV of `num_items` product rows to be turned into a Markdown table."""
    rows = ["sku,product,colour,price,stock"]
    for _ in range(num_items):
        rows.append(
            f"{rng.choice('ABCDEFGH')}{rng.randint(100, 999)}-{rng.randint(10, 99)},{rng.choice(PRODUCTS)},"
            f"{rng.choice(('black', 'white', 'red', 'blue', 'grey', 'green'))},"
            f"{rng.randint(3, 250)}.{rng.randint(0, 99):02d},{rng.randint(0, 500)}"
        )
    csv = "\n".join(rows)
    return (
        "Convert the CSV below into a Markdown table with the same columns and rows, in the same "
        f"order. Reply with the table only.\n\n{csv}"
    )


def _filter_log(rng: random.Random, num_items: int) -> str:
    """A service log of `num_items` lines whose ERROR lines are to be copied out."""
    lines = []
    hour, minute, second = rng.randint(0, 20), rng.randint(0, 59), rng.randint(0, 59)
    for _ in range(num_items):
        second += rng.randint(1, 40)
        minute, second = minute + second // 60, second % 60
        hour, minute = hour + minute // 60, minute % 60
        level = rng.choices(("INFO", "WARN", "ERROR", "DEBUG"), weights=(5, 2, 3, 2))[0]
        message = rng.choice(LOG_MESSAGES).format(
            n=rng.randint(5, 9000), m=rng.randint(1, 99), id=rng.randint(10000, 99999),
            svc=rng.choice(SERVICES), city=rng.choice(CITIES),
        )  # fmt: skip
        lines.append(f"2024-05-17 {hour % 24:02d}:{minute:02d}:{second:02d} {level:<5} [{rng.choice(SERVICES)}] {message}")
    log = "\n".join(lines)
    return (
        "Copy every line of the log below whose level is ERROR, exactly as it appears, one per "
        f"line, and nothing else.\n\n{log}"
    )


TASKS: dict[str, Callable[[random.Random, int], str]] = {
    "rename-code": _rename_code,
    "replace-name": _replace_name,
    "extract-json": _extract_json,
    "csv-to-markdown": _csv_to_markdown,
    "filter-log": _filter_log,
}


def task_prompt(kind: str, seed: int, num_items: int) -> str:
    """The prompt of task `kind` with `num_items` items; a fresh generator per call, so more items
    extend the same text rather than change it (the bisection below relies on that)."""
    if kind not in TASKS:
        raise ValueError(f"unknown copy-heavy task {kind!r}; one of {', '.join(TASKS)}")
    if num_items < 1:
        raise ValueError(f"a copy-heavy prompt needs at least one item, got {num_items}")
    return TASKS[kind](random.Random(seed), num_items)


async def _fit(
    kind: str, seed: int, target: int, max_len: int, count_tokens: Callable[[str], Awaitable[int]]
) -> tuple[str, int]:
    """The prompt with the fewest items that reaches `target` tokens (one item fewer when that
    passes `max_len`; MAX_ITEMS at most), and its length in tokens."""
    low, high = 1, MAX_ITEMS
    while low < high:
        mid = (low + high) // 2
        if await count_tokens(task_prompt(kind, seed, mid)) >= target:
            high = mid
        else:
            low = mid + 1
    prompt = task_prompt(kind, seed, low)
    length = await count_tokens(prompt)
    if length > max_len and low > 1:
        prompt = task_prompt(kind, seed, low - 1)
        length = await count_tokens(prompt)
    return prompt, length


async def copy_heavy_requests(
    num_prompts: int,
    seed: int,
    count_tokens: Callable[[str], Awaitable[int]],
    min_input_len: int = DEFAULT_MIN_INPUT_LEN,
    max_input_len: int = DEFAULT_MAX_INPUT_LEN,
    output_len: int = DEFAULT_OUTPUT_LEN,
    concurrency: int = 16,
) -> list[SampleRequest]:
    """`num_prompts` text prompts, the task kinds in turn, each near a length drawn in
    [min_input_len, max_input_len] tokens (the fewest items reaching it; one item fewer when that
    overshoots max_input_len), in an order shuffled by `seed`."""
    if num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
    if not 0 < min_input_len <= max_input_len:
        raise ValueError(
            f"copy-heavy input lengths need 0 < min <= max, got min {min_input_len}, max {max_input_len}"
        )
    if output_len < 1:
        raise ValueError(f"--copy-heavy-output-len must be >= 1, got {output_len}")
    rng = random.Random(seed)
    kinds = list(TASKS)
    plans = [
        (kinds[i % len(kinds)], rng.randrange(2**32), rng.randint(min_input_len, max_input_len))
        for i in range(num_prompts)
    ]
    limit = asyncio.Semaphore(concurrency)

    async def build(kind: str, prompt_seed: int, target: int) -> SampleRequest:
        async with limit:
            prompt, length = await _fit(kind, prompt_seed, target, max_input_len, count_tokens)
        return SampleRequest(prompt, length, output_len)

    requests = list(await asyncio.gather(*(build(*plan) for plan in plans)))
    rng.shuffle(requests)
    return requests


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("copy-heavy prompts (--dataset-name copy-heavy)")
    group.add_argument(
        "--copy-heavy-min-input-len",
        type=int,
        default=DEFAULT_MIN_INPUT_LEN,
        help="shortest prompt text in tokens (each prompt's length is drawn in [min, max])",
    )
    group.add_argument(
        "--copy-heavy-max-input-len", type=int, default=DEFAULT_MAX_INPUT_LEN, help="longest prompt text in tokens"
    )
    group.add_argument(
        "--copy-heavy-output-len", type=int, default=DEFAULT_OUTPUT_LEN, help="max_tokens of every request"
    )
