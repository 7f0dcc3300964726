"""The multi-LoRA side of `tokenmill bench throughput`: options, engine settings, adapters, requests.

`--lora-adapters N` writes N dummy adapters (bench/lora_adapters.py) at the model's shapes and
spreads the prompts over them round-robin; the engine gets `enable_lora`, `max_loras` = the slots
(`--max-loras`, default min(N, 8)), `max_lora_rank` = the rank and `max_cpu_loras` = max(N, slots),
so every adapter stays in host memory and the timed run measures steps, not disk reads.
`--lora-base-only` builds the same engine but sends every request to the base model: what LoRA
being enabled costs requests without an adapter (issue 18: >= 0.97x LoRA off).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.bench.lora_adapters import ALL_TARGETS, DTYPES, adapter_name, write_dummy_adapters
from tokenmill.lora.adapter_files import SUPPORTED_MODULES
from tokenmill.lora.request import LoRARequest
from tokenmill.model.arch import ArchConfig

DEFAULT_SLOTS_CAP = 8  # --max-loras default: min(N, this)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("multi-LoRA workload (issue 18)")
    group.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        help="write this many dummy PEFT adapters at the model's shapes and spread the prompts over them "
        "round-robin (0: LoRA off, unless --enable-lora)",
    )
    group.add_argument("--lora-rank", type=int, default=16, help="rank of the dummy adapters (and --max-lora-rank)")
    group.add_argument(
        "--lora-targets",
        type=_targets,
        default=ALL_TARGETS,
        help=f"comma-separated modules the adapters adapt (default: {','.join(ALL_TARGETS)})",
    )
    group.add_argument(
        "--lora-base-only",
        action="store_true",
        help="LoRA enabled as for --lora-adapters N, but every request runs on the base model "
        "(no adapter is written): the cost of LoRA to requests without an adapter",
    )
    group.add_argument("--lora-dtype", choices=DTYPES, default="bfloat16", help="dtype of the adapters' files")
    group.add_argument(
        "--lora-dir",
        default=None,
        help="directory of the adapters (lora-000, lora-001, ...); ones already there with this rank, "
        "targets and dtype are reused (default: a temporary directory, removed afterwards)",
    )
    # --max-loras / --max-lora-rank (engine options, defaults 1 and 16) follow the workload unless given.
    for dest in ("max_loras", "max_lora_rank"):
        _mark_given(parser, dest)


class _Given(int):
    """An option's value as parsed from the command line (or --config), not its default."""


def _mark_given(parser: argparse.ArgumentParser, dest: str) -> None:
    """Make `dest`'s parsed values _Given ints, so resolve() tells `--max-loras 1` from the
    engine's default 1 (the engine flags keep their defaults on every command)."""
    for action in parser._actions:  # argparse has no public lookup by dest
        if action.dest == dest:
            parse = action.type or int

            def given(text: str, parse=parse) -> _Given:  # noqa: ANN001 - argparse's type callable
                return _Given(parse(text))

            given.__name__ = getattr(parse, "__name__", "int")  # argparse's "invalid int value" message
            action.type = given
            return
    raise ValueError(f"no option of this parser stores {dest!r}; add the engine options first")


def _given(value: object) -> bool:
    return isinstance(value, _Given)


def _targets(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in SUPPORTED_MODULES]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"--lora-targets {text!r}: expected a comma-separated list of {', '.join(SUPPORTED_MODULES)}"
        )
    return names


@dataclass(frozen=True, slots=True)
class LoRAWorkload:
    adapters: int  # N: adapters the prompts are spread over (base_only: written none, sizes the engine)
    rank: int
    targets: tuple[str, ...]
    slots: int  # max_loras
    host_adapters: int  # max_cpu_loras
    base_only: bool
    dtype: str

    def config_block(self) -> dict[str, Any]:
        """The result's config["lora"]."""
        return {
            "adapters": self.adapters,
            "rank": self.rank,
            "targets": list(self.targets),
            "slots": self.slots,
            "host_adapters": self.host_adapters,
            "base_only": self.base_only,
            "dtype": self.dtype,
            "spread": "none (base model)" if self.base_only else "round-robin",
        }


def resolve(args: argparse.Namespace) -> LoRAWorkload | None:
    """The workload the options ask for (None: no adapters and LoRA not asked for), with the engine
    options in `args` filled in to match; ValueError naming a contradiction."""
    n, rank = args.lora_adapters, args.lora_rank
    if n < 0:
        raise ValueError(f"--lora-adapters must be >= 0, got {n}")
    if rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {rank}")
    if n == 0:
        if args.lora_base_only:
            raise ValueError(
                "--lora-base-only needs --lora-adapters N >= 1: N sizes the engine (slots, host cache) "
                "as in the adapter run it is compared with"
            )
        args.max_loras, args.max_lora_rank = int(args.max_loras), int(args.max_lora_rank)
        return None  # --enable-lora alone still works: the engine options as given
    if getattr(args, "baseline", "none") != "none":
        raise ValueError("--baseline measures transformers without adapters; run it without --lora-adapters")
    slots = int(args.max_loras) if _given(args.max_loras) else min(n, DEFAULT_SLOTS_CAP)
    if slots < 1:
        raise ValueError(f"--max-loras must be >= 1, got {slots}")
    if _given(args.max_lora_rank) and args.max_lora_rank < rank:
        raise ValueError(f"--max-lora-rank {args.max_lora_rank} is below --lora-rank {rank}; drop it or raise it")
    host = args.max_cpu_loras if args.max_cpu_loras is not None else max(n, slots)
    if host < n and not args.lora_base_only:
        raise ValueError(
            f"--max-cpu-loras {host} < --lora-adapters {n}: the timed run would read adapters from disk "
            "again and again; drop --max-cpu-loras (default max(N, slots))"
        )
    args.enable_lora = True
    args.max_loras = slots  # plain ints from here on: the result records them
    args.max_lora_rank = int(args.max_lora_rank) if _given(args.max_lora_rank) else rank
    args.max_cpu_loras = host
    return LoRAWorkload(n, rank, tuple(args.lora_targets), slots, host, args.lora_base_only, args.lora_dtype)


class AdapterSet:
    """The workload's adapters on disk and their LoRARequests (none when base_only); `close()`
    removes a temporary directory."""

    def __init__(self, workload: LoRAWorkload, arch: ArchConfig, directory: str | None, model_name: str | None):
        self._tmp = None
        self.requests: list[LoRARequest] = []
        self.directory: Path | None = None
        if workload.base_only:
            return
        if directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tokenmill-lora-")
            directory = self._tmp.name
        paths = write_dummy_adapters(
            directory, arch, workload.adapters, workload.rank, targets=workload.targets, dtype=workload.dtype,
            base_model_name=model_name,
        )  # fmt: skip
        self.requests = [LoRARequest(adapter_name(i), i + 1, str(p)) for i, p in enumerate(paths)]
        self.directory = Path(directory)

    def per_prompt(self, num_prompts: int) -> list[LoRARequest | None] | None:
        """Prompt i runs with adapter i mod N (None: every prompt on the base model)."""
        if not self.requests:
            return None
        return [self.requests[i % len(self.requests)] for i in range(num_prompts)]

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def lora_counters(llm: Any) -> dict[str, int] | None:
    """The LoRA manager's load counters (host loads from disk, device slot fills), when the engine
    runs its model in this process (uniproc executor); None otherwise or with LoRA off."""
    manager = getattr(llm.engine.executor, "lora_hooks", None)
    if manager is None or not hasattr(manager, "num_slot_loads"):
        return None
    return {"host_loads": manager.num_loads, "slot_loads": manager.num_slot_loads}
