"""Hugging Face Hub ids resolve through huggingface_hub's cache: offline from a snapshot written in
the Hub's layout, online against a fake Hub (HfApi.model_info and the network half of
snapshot_download replaced) that records what is fetched. No test reaches a network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest

from tests.model.hub_cache import FakeHub, commit_hash, repo_folder, use_hf_home, write_hub_snapshot
from tokenmill.config import ModelConfig
from tokenmill.errors import ModelNotFoundError
from tokenmill.model.loader.hub import download
from tokenmill.model.loader.hub_files import FilePlan, HubModelId, plan_files
from tokenmill.model.resolve import pin_snapshots, resolve_model

MAIN = FakeHub.COMMIT
V2 = commit_hash("v2")
REPO = "tiny-org/tiny-llama"


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> Path:
    return use_hf_home(monkeypatch, tmp_path / "hf_home", offline=True)


# --- ids --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen/Qwen2.5-7B-Instruct", HubModelId("Qwen/Qwen2.5-7B-Instruct")),
        ("org/repo/q4_k_m/model-Q4_K_M.gguf", HubModelId("org/repo", "q4_k_m/model-Q4_K_M.gguf")),
        ("/abs/path", None),
        ("./rel/path", None),
        ("~/models/x", None),
        ("just-a-name", None),
        ("org/repo/sub/dir", None),  # a deeper path is a local path, unless it names a GGUF file
        ("org/repo/../x.gguf", None),
    ],
)
def test_hub_ids_are_org_name_or_org_name_file_gguf(name, expected):
    assert HubModelId.parse(name) == expected


# --- offline, from the cache ---------------------------------------------------------------------


def test_a_hub_id_resolves_offline_to_its_cached_snapshot(offline_cache, tiny_llama_dir):
    snapshot = write_hub_snapshot(offline_cache, REPO, tiny_llama_dir, MAIN)
    resolved = resolve_model(ModelConfig(model=REPO))
    assert Path(resolved.path) == snapshot and resolved.tokenizer_path == str(snapshot)
    assert (resolved.format, resolved.name, resolved.revision) == ("safetensors", REPO, MAIN)
    assert resolved.arch.architecture == "llama"
    # The engine process gets the commit, not "main": it resolves the same snapshot.
    pinned = pin_snapshots(ModelConfig(model=REPO), resolved)
    assert pinned.revision == MAIN and resolve_model(pinned).path == resolved.path


def test_revision_picks_a_branch_tag_or_commit(offline_cache, tiny_llama_dir, tiny_qwen3_dir):
    main = write_hub_snapshot(offline_cache, REPO, tiny_llama_dir, MAIN)
    v2 = write_hub_snapshot(offline_cache, REPO, tiny_qwen3_dir, V2, refs=("v2",))
    assert resolve_model(ModelConfig(model=REPO)).path == str(main)
    for revision in ("v2", V2):
        resolved = resolve_model(ModelConfig(model=REPO, revision=revision))
        assert (resolved.path, resolved.revision) == (str(v2), V2)
        assert resolved.arch.architecture == "qwen3"


def test_download_dir_is_the_cache_looked_in(tmp_path, offline_cache, tiny_llama_dir):
    other_cache = tmp_path / "elsewhere"
    snapshot = write_hub_snapshot(other_cache, REPO, tiny_llama_dir, MAIN)
    with pytest.raises(ModelNotFoundError, match="not found in the local cache"):
        resolve_model(ModelConfig(model=REPO))
    assert resolve_model(ModelConfig(model=REPO, download_dir=str(other_cache))).path == str(snapshot)


def test_a_missing_id_offline_says_where_it_looked_why_and_what_to_do(offline_cache):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(ModelConfig(model="some-org/not-cached", revision="v1"))
    message = str(err.value)
    for expected in (
        "'some-org/not-cached'",
        f"not found in the local cache at {offline_cache}",
        "HF_HUB_OFFLINE is set",
        "hf download some-org/not-cached --revision v1",
        "huggingface-cli download",
        "pass the path of a local model directory or .gguf file",
    ):
        assert expected in message, message
    assert err.value.param == "model"


def test_an_incomplete_cached_snapshot_is_reported_offline(offline_cache, tiny_qwen2_dir):
    shards = sorted(p.name for p in tiny_qwen2_dir.glob("*.safetensors"))
    assert len(shards) > 1
    files = [p.name for p in tiny_qwen2_dir.iterdir() if p.name != shards[-1]]
    write_hub_snapshot(offline_cache, REPO, tiny_qwen2_dir, MAIN, files=files)
    with pytest.raises(ModelNotFoundError, match=rf"incomplete snapshot in the local cache at .*weight files missing: {shards[-1]}"):
        resolve_model(ModelConfig(model=REPO))


def test_a_local_path_wins_over_a_hub_id(offline_cache, tiny_llama_dir, tiny_qwen3_dir, tmp_path, monkeypatch):
    write_hub_snapshot(offline_cache, REPO, tiny_llama_dir, MAIN)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_qwen3_dir, tmp_path / REPO)
    resolved = resolve_model(ModelConfig(model=REPO, revision="ignored-for-local-paths"))
    assert resolved.arch.architecture == "qwen3" and resolved.revision is None
    assert Path(resolved.path).resolve() == (tmp_path / REPO).resolve()


def test_a_hub_tokenizer_resolves_to_its_own_snapshot(offline_cache, tiny_llama_dir):
    tokenizer_files = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    tok = write_hub_snapshot(offline_cache, "tiny-org/tok", tiny_llama_dir, V2, files=tokenizer_files)
    resolved = resolve_model(ModelConfig(model=str(tiny_llama_dir), tokenizer="tiny-org/tok"))
    assert (resolved.tokenizer_path, resolved.tokenizer_revision, resolved.revision) == (str(tok), V2, None)
    assert pin_snapshots(ModelConfig(tokenizer="tiny-org/tok"), resolved).tokenizer_revision == V2


def test_gguf_repositories_resolve_to_their_file(offline_cache, tiny_llama_dir, tmp_path):
    from tests.model.test_loader import _write_gguf_like_llama_cpp

    remote = tmp_path / "remote"
    remote.mkdir()
    _write_gguf_like_llama_cpp(tiny_llama_dir, remote / "tiny-F32.gguf")
    snapshot = write_hub_snapshot(offline_cache, "tiny-org/tiny-gguf", remote, MAIN)
    for name in ("tiny-org/tiny-gguf", "tiny-org/tiny-gguf/tiny-F32.gguf"):
        resolved = resolve_model(ModelConfig(model=name))
        assert (resolved.path, resolved.format) == (str(snapshot / "tiny-F32.gguf"), "gguf"), name
        assert resolved.tokenizer_path == resolved.path and resolved.name == name


# --- online, against a fake Hub ------------------------------------------------------------------


@pytest.fixture
def online_cache(tmp_path, monkeypatch) -> Path:
    return use_hf_home(monkeypatch, tmp_path / "hf_home", offline=False)


def _remote(tmp_path: Path, source: Path, extra: dict[str, bytes]) -> Path:
    remote = tmp_path / "remote"
    shutil.copytree(source, remote)
    for name, data in extra.items():
        (remote / name).parent.mkdir(parents=True, exist_ok=True)
        (remote / name).write_bytes(data)
    return remote


def test_only_the_files_a_model_needs_are_fetched(online_cache, tmp_path, monkeypatch, tiny_llama_dir):
    junk = {
        "pytorch_model.bin": b"never fetched: safetensors win",
        "original/consolidated.00.pth": b"never fetched",
        "original/params.json": b"{}",
        "README.md": b"# card",
        ".gitattributes": b"*.bin filter=lfs",
        "training_args.bin": b"never fetched",
    }
    hub = FakeHub(monkeypatch, online_cache, _remote(tmp_path, tiny_llama_dir, junk))
    resolved = resolve_model(ModelConfig(model=REPO))
    metadata = ["chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    assert hub.fetched == [metadata, ["model.safetensors"]]
    snapshot = repo_folder(online_cache, REPO) / "snapshots" / MAIN
    assert resolved.path == str(snapshot) and resolved.revision == MAIN and resolved.format == "safetensors"
    assert sorted(p.name for p in snapshot.iterdir()) == sorted([*metadata, "model.safetensors"])
    # Pinned to the commit, the engine process finds it in the cache and asks the Hub nothing.
    calls = hub.info_calls
    assert resolve_model(pin_snapshots(ModelConfig(model=REPO), resolved)).path == resolved.path
    assert hub.info_calls == calls and len(hub.fetched) == 2


def test_a_sharded_checkpoint_fetches_the_shards_its_index_lists(online_cache, tmp_path, monkeypatch, tiny_qwen2_dir):
    extra = {"consolidated.safetensors": b"a second copy in another layout, not in the index"}
    hub = FakeHub(monkeypatch, online_cache, _remote(tmp_path, tiny_qwen2_dir, extra))
    resolve_model(ModelConfig(model=REPO))
    index = json.loads((tiny_qwen2_dir / "model.safetensors.index.json").read_text())
    assert "model.safetensors.index.json" in hub.fetched[0]
    assert hub.fetched[1] == sorted(set(index["weight_map"].values()))


def test_pytorch_bin_is_fetched_only_without_safetensors(online_cache, tmp_path, monkeypatch, tiny_llama_dir):
    remote = _remote(tmp_path, tiny_llama_dir, {"pytorch_model.bin": b"weights"})
    (remote / "model.safetensors").unlink()
    hub = FakeHub(monkeypatch, online_cache, remote)
    resolved = resolve_model(ModelConfig(model=REPO))
    assert hub.fetched[1] == ["pytorch_model.bin"] and resolved.format == "pt"


def test_dummy_weights_fetch_only_the_metadata(online_cache, tmp_path, monkeypatch, tiny_llama_dir):
    hub = FakeHub(monkeypatch, online_cache, _remote(tmp_path, tiny_llama_dir, {}))
    resolved = resolve_model(ModelConfig(model=REPO, load_format="dummy"))
    assert resolved.format == "dummy" and len(hub.fetched) == 1
    assert not any(name.endswith(".safetensors") for name in hub.fetched[0])


@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("tiny-org/one-gguf", {"m-Q8_0.gguf": b"GGUF"}),
        ("tiny-org/gguf/q/m-Q4.gguf", {"q/m-Q4.gguf": b"GGUF", "m-Q8_0.gguf": b"GGUF"}),
    ],
)
def test_a_gguf_is_fetched_alone(online_cache, tmp_path, monkeypatch, name, extra):
    empty = tmp_path / "empty"
    empty.mkdir()
    hub = FakeHub(monkeypatch, online_cache, _remote(tmp_path, empty, {"README.md": b"# card", **extra}))
    hub_id = HubModelId.parse(name)
    snapshot = download(hub_id, revision=None, cache_dir=None)
    wanted = hub_id.filename or "m-Q8_0.gguf"
    assert hub.fetched == [[wanted]]
    assert snapshot.path == repo_folder(online_cache, hub_id.repo_id) / "snapshots" / MAIN / wanted
    assert snapshot.path.read_bytes() == b"GGUF"


def _http_error(cls, status: int, message: str):
    response = SimpleNamespace(status_code=status, headers={}, request=None)
    return cls(message, response=response)


def test_a_gated_repository_without_a_token_says_how_to_get_access(online_cache, tmp_path, monkeypatch, tiny_llama_dir):
    from huggingface_hub.errors import GatedRepoError

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    hub = FakeHub(monkeypatch, online_cache, _remote(tmp_path, tiny_llama_dir, {}))
    hub.download_error = _http_error(GatedRepoError, 401, "401 Client Error: access to model is restricted")
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(ModelConfig(model=REPO))
    message = str(err.value)
    for expected in ("gated repository", "no token is set", f"https://huggingface.co/{REPO}", "HF_TOKEN"):
        assert expected in message, message


@pytest.mark.parametrize(
    ("error_class", "expected"),
    [
        ("RepositoryNotFoundError", "was not found on the Hugging Face Hub"),
        ("RevisionNotFoundError", "has no revision 'main'"),
    ],
)
def test_the_hubs_refusals_are_explained(online_cache, tmp_path, monkeypatch, tiny_llama_dir, error_class, expected):
    from huggingface_hub import errors

    error = _http_error(getattr(errors, error_class), 404, "404 Client Error")
    FakeHub(monkeypatch, online_cache, _remote(tmp_path, tiny_llama_dir, {}), info_error=error)
    with pytest.raises(ModelNotFoundError, match=expected):
        resolve_model(ModelConfig(model=REPO))


def test_an_unreachable_hub_falls_back_to_the_cache_or_says_so(online_cache, tmp_path, monkeypatch, tiny_llama_dir):
    hub = FakeHub(
        monkeypatch, online_cache, _remote(tmp_path, tiny_llama_dir, {}),
        info_error=ConnectionError("Failed to resolve 'huggingface.co'"),
    )  # fmt: skip
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model(ModelConfig(model=REPO))
    message = str(err.value)
    assert "the Hugging Face Hub is not reachable (ConnectionError: Failed to resolve" in message, message
    assert f"not found in the local cache at {online_cache}" in message and f"hf download {REPO}" in message
    snapshot = write_hub_snapshot(online_cache, REPO, tiny_llama_dir, MAIN)
    assert resolve_model(ModelConfig(model=REPO)).path == str(snapshot) and hub.fetched == []


# --- which files: the plan alone --------------------------------------------------------------------


def test_gguf_repositories_take_their_one_file_or_ask_which():
    repo = HubModelId("org/m-GGUF")
    assert plan_files(["README.md", "m-Q4_K_M.gguf"], repo, "auto") == FilePlan(
        first=[], weights=["m-Q4_K_M.gguf"], gguf_file="m-Q4_K_M.gguf"
    )
    many = ["m-Q4_K_M.gguf", "m-Q8_0.gguf"]
    with pytest.raises(ModelNotFoundError, match=r"holds 2 GGUF files \(m-Q4_K_M.gguf, m-Q8_0.gguf\); name one as org/m-GGUF/FILE.gguf"):
        plan_files(many, repo, "auto")
    assert plan_files(many, HubModelId("org/m-GGUF", "m-Q8_0.gguf"), "auto").gguf_file == "m-Q8_0.gguf"
    with pytest.raises(ModelNotFoundError, match="has no file 'm-F16.gguf'; its GGUF files: m-Q4_K_M.gguf, m-Q8_0.gguf"):
        plan_files(many, HubModelId("org/m-GGUF", "m-F16.gguf"), "auto")
    # A repository with both: safetensors unless --load-format gguf.
    both = ["config.json", "model.safetensors", "m.gguf"]
    assert plan_files(both, repo, "auto").weights == ["model.safetensors"]
    assert plan_files(both, repo, "gguf").gguf_file == "m.gguf"


def test_a_repository_without_loadable_weights_is_refused_naming_its_files():
    with pytest.raises(ModelNotFoundError, match=r"holds no weights .* load_format='auto' .* it has config.json, model.onnx"):
        plan_files(["config.json", "model.onnx"], HubModelId("org/onnx-only"), "auto")
    with pytest.raises(ModelNotFoundError, match="load_format='pt'"):
        plan_files(["config.json", "model.safetensors"], HubModelId("org/m"), "pt")
    with pytest.raises(ModelNotFoundError, match="holds no tokenizer.json, tokenizer_config.json, tokenizer.model nor"):
        plan_files(["README.md"], HubModelId("org/m"), "auto", purpose="tokenizer")
