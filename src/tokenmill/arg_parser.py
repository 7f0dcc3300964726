"""tokenmill's argument parser: `--config FILE.yaml` (vLLM's form) and the value parsers of its flags.

A config file is a YAML mapping of option names (dashes or underscores: `max-num-seqs: 8`). Its
entries become flags placed before the command line's own, so a flag given on the command line
wins (argparse keeps the last value) and every value goes through the same parsing and checks as
if it had been typed. The subcommand's own parser does the expansion: it alone knows which
options exist, so an unknown key is refused naming the key, the file and close valid names.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"


def parse_bytes(value: str) -> int:
    """'4GiB', '512MiB', '1e9' or a plain byte count."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    text = value.strip().lower()
    try:
        for suffix, scale in units.items():
            if text.endswith(suffix):
                return int(float(text[: -len(suffix)]) * scale)
        return int(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a byte count such as 2GiB, 512MiB or 1e9, got {value!r}"
        ) from None


def close_names(name: str, valid: Sequence[str]) -> str:
    """'; did you mean a or b?' for the valid names close to `name`, else ''."""
    matches = difflib.get_close_matches(name, list(valid), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(matches)}?" if matches else ""


class _ConfigFileAction(argparse.Action):
    """Reached only when a parser that does not expand config files meets --config."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        parser.error(f"{CONFIG_FLAG} needs tokenmill.arg_parser.ArgumentParser, which reads the file")


def add_config_file_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        CONFIG_FLAG,
        action=_ConfigFileAction,
        default=None,
        metavar="FILE.yaml",
        help="read options from a YAML mapping of option names (e.g. 'max-num-seqs: 8'); "
        "flags given on the command line override the file",
    )


class ArgumentParser(argparse.ArgumentParser):
    """argparse, expanding `--config FILE.yaml` in the (sub)parser that declares it."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        path = None
        if CONFIG_FLAG in self._option_string_actions:
            argv, path = self._expand_config_file(argv)
        parsed, rest = super().parse_known_args(argv, namespace)
        if path is not None:
            parsed.config = path
        return parsed, rest

    def _expand_config_file(self, argv: list[str]) -> tuple[list[str], str | None]:
        positions = [i for i, a in enumerate(argv) if a == CONFIG_FLAG or a.startswith(CONFIG_FLAG + "=")]
        if not positions:
            return argv, None
        if len(positions) > 1:
            self.error(f"{CONFIG_FLAG} is given {len(positions)} times; give one file")
        i = positions[0]
        if argv[i] == CONFIG_FLAG:
            if i + 1 >= len(argv):
                self.error(f"argument {CONFIG_FLAG}: expected a file name")
            path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
        else:
            path, rest = argv[i].split("=", 1)[1], argv[:i] + argv[i + 1 :]
        return self._config_file_flags(path) + rest, path

    def _config_file_flags(self, path: str) -> list[str]:
        import yaml

        try:
            options = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            self.error(f"cannot read config file {path}: {exc}")
        if options is None:
            return []
        if not isinstance(options, dict):
            self.error(f"config file {path} must hold a mapping of option names to values")
        valid = sorted(
            s[2:] for s in self._option_string_actions if s.startswith("--") and not s.startswith("--no-")
        )
        flags: list[str] = []
        for key, value in options.items():
            name = str(key).replace("_", "-")
            action = self._option_string_actions.get("--" + name)
            if action is None or name in ("config", "help"):
                self.error(
                    f"unknown option {key!r} in config file {path}{close_names(name, valid)} "
                    f"(valid options: {', '.join(v for v in valid if v not in ('config', 'help'))})"
                )
            flags += _as_flags(name, action, value)
        return flags


def _as_flags(name: str, action: argparse.Action, value: Any) -> list[str]:
    """The command-line form of one config-file entry."""
    if value is None:
        return []
    flag = "--" + name
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag] if value else ["--no-" + name]
    if action.nargs == 0:  # store_true / store_false: the flag sets `const`
        return [flag] if value == action.const else []
    if isinstance(value, list) and action.nargs in ("+", "*"):  # a flag of several values
        return [flag, *(str(v) for v in value)] if value else []
    if isinstance(value, dict | list):
        value = json.dumps(value)
    elif isinstance(value, bool):
        value = str(value).lower()
    # `--flag=value`: a value starting with '-' is not taken for another flag.
    return [f"{flag}={value}"]
