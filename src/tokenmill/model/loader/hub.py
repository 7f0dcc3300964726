"""Hugging Face Hub ids to local snapshots, through `huggingface_hub`: its cache (shared with every
other Hugging Face tool), its token (`HF_TOKEN` or `hf auth login`), its offline mode
(`HF_HUB_OFFLINE=1`) and its progress bars.

An id is `ORG/NAME`, or `ORG/NAME/FILE.gguf` for one GGUF file of a repository. Only the files a
model needs are fetched (`hub_files.py` says which): configs, tokenizer files and weight indexes
first, then, once the config has passed the caller's check, one kind of weights.

Resolution pins a revision to the commit it found (`HubSnapshot.commit`): the API server resolves
first and hands the engine process that commit, and a commit, being immutable, is looked up in the
cache before the Hub is asked, so both processes load the same snapshot and the second asks nothing.

Torch-free (the API server process resolves models); `huggingface_hub` is imported when an id is
resolved, not with this module.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tokenmill.errors import ModelNotFoundError
from tokenmill.model.loader.hf_config import indexed_weight_files
from tokenmill.model.loader.hub_files import HubModelId, Purpose, missing_files, plan_files

logger = logging.getLogger(__name__)

_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True, slots=True)
class HubSnapshot:
    repo_id: str
    commit: str  # the commit the revision resolved to: pass it as the revision to get this snapshot again
    path: Path  # the snapshot directory in the cache, or the .gguf file in it


def download(
    hub_id: HubModelId,
    *,
    revision: str | None,
    cache_dir: str | None,
    load_format: str = "auto",
    purpose: Purpose = "model",
    check_metadata: Callable[[Path], None] | None = None,
) -> HubSnapshot:
    """The local snapshot of `hub_id` at `revision` (default: main) holding what `purpose` needs
    (weights in `load_format`, or only a tokenizer), fetched into the cache unless it is there.
    `check_metadata(directory)` runs once the configs are there and before any weight is fetched:
    a model refused for its config (its architecture, its quantization) costs no download.

    Raises ModelNotFoundError saying what went wrong and what to do: not on the Hub, gated or
    private without a token, no such revision, or offline / unreachable and not in the cache."""
    from huggingface_hub import constants

    revision = revision or "main"
    if _COMMIT.fullmatch(revision):  # immutable: the cache's copy is the Hub's
        cached = _cached_snapshot(hub_id, revision, cache_dir, load_format, purpose)
        if isinstance(cached, HubSnapshot):
            return cached
    if constants.HF_HUB_OFFLINE:
        return _from_cache_or_explain(
            hub_id, revision, cache_dir, load_format, purpose, "HF_HUB_OFFLINE is set, so the Hub was not asked"
        )
    info = _model_info(hub_id, revision, cache_dir, load_format, purpose)
    if isinstance(info, HubSnapshot):  # the Hub was unreachable and the cache had it
        return info
    files = [sibling.rfilename for sibling in info.siblings or []]
    plan = plan_files(files, hub_id, load_format, purpose)
    directory: Path | None = None
    if plan.first:
        directory = _snapshot_download(hub_id, info.sha, cache_dir, plan.first)
        if check_metadata is not None:
            check_metadata(directory)
    weights = list(plan.weights)
    if plan.weight_index is not None:
        assert directory is not None  # the index is one of `first`
        weights += indexed_weight_files(directory / plan.weight_index)
    if weights:
        directory = _snapshot_download(hub_id, info.sha, cache_dir, weights)
    assert directory is not None, f"empty plan {plan}"  # plan_files refuses a repository with nothing to fetch
    path = directory / plan.gguf_file if plan.gguf_file else directory
    return HubSnapshot(hub_id.repo_id, info.sha, path)


# -- talking to the Hub --------------------------------------------------------------------------


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """What huggingface_hub raises when the Hub cannot be reached: OfflineModeIsEnabled (a
    ConnectionError), OSError (its HTTP errors for 5xx answers, requests' connection errors), and
    the transport errors of the HTTP client it is built on (httpx in recent versions), whose base
    its `errors` module imports as HTTPError."""
    from huggingface_hub import errors

    return (OSError, getattr(errors, "HTTPError", OSError))


@contextmanager
def _hub_errors(hub_id: HubModelId, revision: str) -> Iterator[None]:
    """The Hub's answers that no cache can fix, as errors saying what to do."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token_state = "a token is set" if get_token() else "no token is set"
    try:
        yield
    except GatedRepoError as exc:
        raise ModelNotFoundError(
            f"{hub_id.repo_id} is a gated repository and {token_state} that may read it: accept its "
            f"conditions at https://huggingface.co/{hub_id.repo_id} with your Hugging Face account, then "
            f"give that account's token (HF_TOKEN=hf_..., or `hf auth login`) ({_first_line(exc)})",
            param="model",
        ) from exc
    except RevisionNotFoundError as exc:
        raise ModelNotFoundError(
            f"{hub_id.repo_id} has no revision {revision!r} on the Hugging Face Hub; pass a branch, tag or "
            f"commit it has with --revision ({_first_line(exc)})",
            param="model",
        ) from exc
    except RepositoryNotFoundError as exc:
        raise ModelNotFoundError(
            f"model {hub_id.repo_id!r} is no local directory or file, and was not found on the Hugging Face "
            f"Hub ({token_state}): check the name or the path, or if the repository is private give a token "
            f"that may read it (HF_TOKEN=hf_..., or `hf auth login`) ({_first_line(exc)})",
            param="model",
        ) from exc
    except HFValidationError as exc:
        raise ModelNotFoundError(
            f"{str(hub_id)!r} is no local path and not a valid Hugging Face Hub id: {_first_line(exc)}",
            param="model",
        ) from exc


def _model_info(hub_id: HubModelId, revision: str, cache_dir: str | None, load_format: str, purpose: Purpose):
    """The Hub's listing of the repository at `revision`, or, when the Hub cannot be reached, the
    cached snapshot (a HubSnapshot) if there is one."""
    from huggingface_hub import HfApi

    from tokenmill import __version__

    api = HfApi(library_name="tokenmill", library_version=__version__)
    try:
        with _hub_errors(hub_id, revision):
            return api.model_info(hub_id.repo_id, revision=revision)
    except _unreachable_errors() as exc:  # not ModelNotFoundError: _hub_errors' answers pass through
        return _from_cache_or_explain(
            hub_id, revision, cache_dir, load_format, purpose,
            f"the Hugging Face Hub is not reachable ({type(exc).__name__}: {_first_line(exc)})",
        )  # fmt: skip


def _snapshot_download(hub_id: HubModelId, commit: str, cache_dir: str | None, files: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    from tokenmill import __version__

    with _hub_errors(hub_id, commit):
        # The file names as patterns: fnmatch matches a name without wildcards only to itself.
        return Path(
            snapshot_download(
                hub_id.repo_id, revision=commit, cache_dir=cache_dir, allow_patterns=files,
                library_name="tokenmill", library_version=__version__,
            )
        )  # fmt: skip


# -- the cache -------------------------------------------------------------------------------------


def _cached_snapshot(
    hub_id: HubModelId, revision: str, cache_dir: str | None, load_format: str, purpose: Purpose
) -> HubSnapshot | str:
    """The cached snapshot of `hub_id` at `revision` if it holds what `purpose` needs, else why not."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = cache_dir or constants.HF_HUB_CACHE

    try:
        # Finds refs/<revision> and snapshots/<commit> without asking the Hub. Asked for one file
        # every online fetch takes (config.json, or the named GGUF), so that huggingface_hub's own
        # completeness check (against the file listing it cached, in recent versions) does not ask
        # for files this module never fetched.
        directory = Path(
            snapshot_download(
                hub_id.repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True,
                allow_patterns=[hub_id.filename or "config.json"],
            )
        )  # fmt: skip
    except LocalEntryNotFoundError:  # its text is advice to pass local_files_only=False, not ours
        return f"was not found in the local cache at {where}"
    missing = missing_files(directory, hub_id, load_format, purpose)
    if missing:
        return f"has an incomplete snapshot in the local cache at {where} ({directory}: {missing})"
    path = directory / hub_id.filename if hub_id.filename else directory
    return HubSnapshot(hub_id.repo_id, directory.name, path)  # snapshots/<commit>


def _from_cache_or_explain(
    hub_id: HubModelId, revision: str, cache_dir: str | None, load_format: str, purpose: Purpose, reason: str
) -> HubSnapshot:
    """The cached snapshot, the Hub being out of reach; else an error saying so and what to do."""
    cached = _cached_snapshot(hub_id, revision, cache_dir, load_format, purpose)
    if isinstance(cached, HubSnapshot):
        logger.info("%s: %s; using the cached snapshot %s", hub_id, reason, cached.path)
        return cached
    revision_flag = "" if revision == "main" else f" --revision {revision}"
    download_dir = f" --cache-dir {cache_dir}" if cache_dir else ""
    raise ModelNotFoundError(
        f"{'tokenizer' if purpose == 'tokenizer' else 'model'} {str(hub_id)!r} (revision {revision!r}) is no "
        f"local directory or file, and as a Hugging Face Hub id it {cached}; {reason}. Download it where the "
        "Hub is reachable "
        f"(`hf download {hub_id.repo_id}{revision_flag}{download_dir}`, or `huggingface-cli download ...` "
        "with older huggingface_hub) and copy the cache here (HF_HOME or --download-dir), or pass the "
        "path of a local model directory or .gguf file",
        param="model",
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
