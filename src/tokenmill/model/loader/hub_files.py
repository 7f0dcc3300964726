"""Which files of a Hugging Face Hub repository a model needs, and whether a snapshot has them.

An id is `ORG/NAME`, or `ORG/NAME/FILE.gguf` for one GGUF file of a repository. A model needs the
top-level configs, tokenizer files, chat templates and weight indexes (`*.json`, `*.jinja`,
`*.model`, `*.tiktoken`, `*.txt`), then one kind of weights: `*.safetensors` (the shards the index
lists, when there is one), else `pytorch_model*.bin`, else the repository's one GGUF file; never
`original/` consolidated copies, READMEs or images. A tokenizer, or dummy weights, needs only the
metadata. Pure functions of file names (and, for a snapshot, of the files on disk): `hub.py` does
the fetching.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tokenmill.errors import ModelNotFoundError
from tokenmill.model.loader.hf_config import (
    INDEX_FILE,
    PT_INDEX_FILE,
    PT_WEIGHTS_GLOB,
    pytorch_bin_files,
    safetensors_files,
)

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Small top-level files a model or its tokenizer may need: config.json, generation_config.json,
# tokenizer.json / tokenizer_config.json / special_tokens_map.json / vocab.json / merges.txt /
# tokenizer.model / *.tiktoken, chat_template.jinja / .json, and the weight indexes.
METADATA_GLOBS = ("*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

Purpose = Literal["model", "tokenizer"]


@dataclass(frozen=True, slots=True)
class HubModelId:
    repo_id: str  # ORG/NAME
    filename: str | None = None  # one .gguf file of the repository (ORG/NAME/FILE.gguf)

    @classmethod
    def parse(cls, name: str) -> HubModelId | None:
        """The id `name` spells, or None when it cannot be one (an absolute path, `./x`, `a/b/c`)."""
        parts = name.split("/")
        if len(parts) < 2 or not _REPO_ID.fullmatch("/".join(parts[:2])):
            return None
        repo_id = "/".join(parts[:2])
        if len(parts) == 2:
            return cls(repo_id)
        filename = "/".join(parts[2:])
        if filename.endswith(".gguf") and all(parts[2:]) and ".." not in parts[2:]:
            return cls(repo_id, filename)
        return None

    def __str__(self) -> str:
        return f"{self.repo_id}/{self.filename}" if self.filename else self.repo_id


@dataclass(frozen=True, slots=True)
class FilePlan:
    """What to fetch from a repository: `first` (configs, tokenizer, indexes), then `weights` and
    the files `weight_index` (one of `first`) lists. A GGUF file is the model: `gguf_file`, alone."""

    first: list[str]
    weights: list[str] = field(default_factory=list)
    weight_index: str | None = None
    gguf_file: str | None = None  # the snapshot's model is this file, not the directory


def plan_files(files: list[str], hub_id: HubModelId, load_format: str, purpose: Purpose = "model") -> FilePlan:
    """Which of a repository's `files` to fetch: top-level metadata, then one kind of weights
    (safetensors before pytorch_model*.bin before a GGUF file); only metadata for a tokenizer or
    dummy weights, unless the model is a GGUF file, which carries its config and tokenizer."""
    if hub_id.filename is not None:
        if hub_id.filename not in files:
            ggufs = [f for f in files if f.endswith(".gguf")]
            raise ModelNotFoundError(
                f"{hub_id.repo_id} has no file {hub_id.filename!r}; its GGUF files: {listing(ggufs)}",
                param="model",
            )
        return FilePlan(first=[], weights=[hub_id.filename], gguf_file=hub_id.filename)
    top = [f for f in files if "/" not in f]
    metadata = [f for f in top if any(fnmatch.fnmatchcase(f, glob) for glob in METADATA_GLOBS)]
    safetensors = [f for f in top if f.endswith(".safetensors")]
    pt_bins = [f for f in top if fnmatch.fnmatchcase(f, PT_WEIGHTS_GLOB)]
    ggufs = [f for f in top if f.endswith(".gguf")]  # one in a folder is named: ORG/NAME/DIR/FILE.gguf
    has_config = "config.json" in top if purpose == "model" else any(f in top for f in TOKENIZER_FILES)

    if purpose == "tokenizer" or load_format == "dummy":
        if has_config:
            return FilePlan(first=metadata)
        if ggufs:
            return _gguf_plan(hub_id, ggufs)  # a GGUF file carries its config and tokenizer
        wanted = ", ".join(TOKENIZER_FILES) if purpose == "tokenizer" else "config.json"
        raise ModelNotFoundError(
            f"{hub_id.repo_id} holds no {wanted} nor a .gguf file (it has {listing(files)})", param=purpose
        )
    if load_format in ("auto", "safetensors") and safetensors:
        if INDEX_FILE in top:
            return FilePlan(first=metadata, weight_index=INDEX_FILE)
        return FilePlan(first=metadata, weights=safetensors)
    if load_format in ("auto", "pt") and pt_bins:
        if PT_INDEX_FILE in top:
            return FilePlan(first=metadata, weight_index=PT_INDEX_FILE)
        return FilePlan(first=metadata, weights=pt_bins)
    if (load_format == "gguf" or (load_format == "auto" and not has_config)) and ggufs:
        return _gguf_plan(hub_id, ggufs)
    wanted = {
        "auto": "*.safetensors, pytorch_model*.bin or a .gguf file",
        "safetensors": "*.safetensors",
        "pt": "pytorch_model*.bin",
        "gguf": ".gguf",
    }.get(load_format, load_format)
    raise ModelNotFoundError(
        f"{hub_id.repo_id} holds no weights tokenmill loads with load_format={load_format!r} (looked for "
        f"{wanted} files at the top of the repository; it has {listing(files)})",
        param="model",
    )


def _gguf_plan(hub_id: HubModelId, ggufs: list[str]) -> FilePlan:
    if len(ggufs) != 1:
        raise ModelNotFoundError(
            f"{hub_id.repo_id} holds {len(ggufs)} GGUF files ({listing(ggufs)}); name one as "
            f"{hub_id.repo_id}/FILE.gguf",
            param="model",
        )
    return FilePlan(first=[], weights=[ggufs[0]], gguf_file=ggufs[0])


def listing(names: list[str], limit: int = 12) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


def missing_files(directory: Path, hub_id: HubModelId, load_format: str, purpose: Purpose) -> str | None:
    """What a cached snapshot lacks to load (None: nothing)."""
    if hub_id.filename is not None:
        return None if (directory / hub_id.filename).is_file() else f"{hub_id.filename} is missing"
    ggufs = sorted(directory.glob("*.gguf"))
    if purpose == "tokenizer":
        found = any((directory / name).is_file() for name in TOKENIZER_FILES) or ggufs
        return None if found else f"no tokenizer files ({', '.join(TOKENIZER_FILES)})"
    if not (directory / "config.json").is_file():
        return None if len(ggufs) == 1 else "no config.json"
    if load_format == "dummy":
        return None
    candidates = {"auto": ("safetensors", "pt"), "safetensors": ("safetensors",), "pt": ("pt",)}
    for kind in candidates.get(load_format, ()):
        files = safetensors_files(directory) if kind == "safetensors" else pytorch_bin_files(directory)
        if files:
            missing = [f.name for f in files if not f.is_file()]
            return f"weight files missing: {listing(missing)}" if missing else None
    return None if load_format == "gguf" and ggufs else f"no weights for load_format={load_format!r}"
