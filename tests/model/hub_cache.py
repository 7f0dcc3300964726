"""A Hugging Face Hub cache written by hand, for tests on machines that reach no Hub.

The layout is huggingface_hub's (what `hf download` writes and `snapshot_download` reads):
`<cache>/models--ORG--NAME/blobs/<sha256 of the content>`, `snapshots/<commit>/<file>` symlinks to
`../../blobs/<sha256>` (nested files: `../../../blobs/...`), and `refs/<branch or tag>` holding the
commit. `use_hf_home` points huggingface_hub at a temporary HF_HOME, in this process (its constants
were read at import) and in child processes (the environment). `FakeHub` stands in for the Hub's
network half.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest

OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def repo_folder(hub_cache: Path, repo_id: str) -> Path:
    return hub_cache / ("models--" + repo_id.replace("/", "--"))


def write_hub_snapshot(
    hub_cache: Path,
    repo_id: str,
    source: Path,
    commit: str,
    *,
    refs: tuple[str, ...] = ("main",),
    files: list[str] | None = None,
) -> Path:
    """Store `files` of `source` (default: every file under it) as the snapshot `commit` of
    `repo_id`, named by `refs`; returns the snapshot directory."""
    assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit), commit
    storage = repo_folder(hub_cache, repo_id)
    snapshot = storage / "snapshots" / commit
    names = files if files is not None else sorted(
        str(p.relative_to(source)) for p in source.rglob("*") if p.is_file()
    )
    for name in names:
        data = (source / name).read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    snapshot.mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)  # no newline: huggingface_hub reads it verbatim
    return snapshot


def commit_hash(label: str) -> str:
    """A commit id (40 hex digits) made from a label, for readable tests."""
    return hashlib.sha1(label.encode()).hexdigest()


def use_hf_home(monkeypatch: pytest.MonkeyPatch, hf_home: Path, *, offline: bool) -> Path:
    """huggingface_hub's cache at `hf_home`/hub and its offline mode as asked; returns the cache."""
    from huggingface_hub import constants

    hub_cache = hf_home / "hub"
    hub_cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", *OFFLINE_ENV):
        monkeypatch.delenv(name, raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(hf_home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)
    return hub_cache


class FakeHub:
    """HfApi.model_info answers from `remote` (a directory: the repository at commit COMMIT);
    snapshot_download's network half copies the asked files into the cache; local_files_only
    calls run the real function. `fetched` records each download's allow_patterns."""

    COMMIT = commit_hash("main")

    def __init__(self, monkeypatch, hub_cache: Path, remote: Path, *, info_error: Exception | None = None):
        self.hub_cache, self.remote, self.info_error = hub_cache, remote, info_error
        self.fetched: list[list[str]] = []
        self.info_calls = 0
        self.download_error: Exception | None = None
        real_snapshot_download = huggingface_hub.snapshot_download

        def model_info(api, repo_id, revision=None, **kwargs):
            self.info_calls += 1
            if self.info_error is not None:
                raise self.info_error
            files = sorted(str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file())
            return SimpleNamespace(sha=self.COMMIT, siblings=[SimpleNamespace(rfilename=f) for f in files])

        def snapshot_download(repo_id, *, revision=None, cache_dir=None, allow_patterns=None, **kwargs):
            if kwargs.get("local_files_only"):
                return real_snapshot_download(
                    repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=allow_patterns, **kwargs
                )
            if self.download_error is not None:
                raise self.download_error
            assert revision == self.COMMIT, "downloads are pinned to the commit model_info gave"
            self.fetched.append(sorted(allow_patterns))
            return str(
                write_hub_snapshot(Path(cache_dir or hub_cache), repo_id, remote, self.COMMIT, files=allow_patterns)
            )

        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
