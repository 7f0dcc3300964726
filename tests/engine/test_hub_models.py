"""Models named by Hugging Face Hub id, end to end, offline: a snapshot in the Hub's cache layout
under a temporary HF_HOME, HF_HUB_OFFLINE=1. The offline LLM generates what transformers does;
`tokenmill serve ORG/NAME` takes the id and its Hub flags; the API server pins the revision to the
commit it resolved before the engine process starts, and serves a request without importing torch."""

from __future__ import annotations

import asyncio
import os

import pytest

from tests.engine.hf_oracle import hf_greedy
from tests.model.hub_cache import commit_hash, use_hf_home, write_hub_snapshot
from tests.server.test_api_server_imports import SERVE_ONE_REQUEST, _engine_side_modules_after
from tokenmill import LLM, SamplingParams
from tokenmill.cli import build_parser
from tokenmill.config import EngineConfig, ModelConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.core_process_client import CoreProcessClient
from tokenmill.server.launch import build_server

REPO = "tiny-org/tiny-llama"
MAIN = commit_hash("main")


@pytest.fixture
def cached_repo(tmp_path, monkeypatch, tiny_llama_dir):
    """The tiny Llama as the snapshot MAIN of REPO in an offline Hub cache; returns the snapshot."""
    hub_cache = use_hf_home(monkeypatch, tmp_path / "hf_home", offline=True)
    monkeypatch.chdir(tmp_path)  # no local directory of the id's name
    return write_hub_snapshot(hub_cache, REPO, tiny_llama_dir, MAIN)


def test_llm_loads_a_hub_id_offline_and_generates_what_transformers_does(cached_repo, tiny_llama_dir):
    llm = LLM(REPO, device="cpu", max_model_len=64, num_kv_blocks=16)
    assert (llm.resolved.path, llm.resolved.revision, llm.resolved.name) == (str(cached_repo), MAIN, REPO)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = llm.get_tokenizer().encode("the quick brown fox")
    out = llm.generate(["the quick brown fox"], params)[0]
    assert out.prompt_token_ids == prompt  # the snapshot's tokenizer
    assert out.outputs[0].token_ids == hf_greedy(str(tiny_llama_dir), prompt, 8)[0]


def test_serve_takes_a_hub_id_and_its_flags(tmp_path):
    argv = [
        "serve", REPO, "--device", "cpu", "--revision", "v2", "--download-dir", str(tmp_path / "cache"),
        "--tokenizer", "tiny-org/tok", "--tokenizer-revision", "t1", "--load-format", "pt",
    ]  # fmt: skip
    server = build_server(build_parser().parse_args(argv))  # builds only: nothing is resolved yet
    asyncio.run(server.tm_state.engine.shutdown())
    model = server.tm_state.engine.config.model
    assert (model.model, model.revision, model.download_dir) == (REPO, "v2", str(tmp_path / "cache"))
    assert (model.tokenizer, model.tokenizer_revision, model.load_format) == ("tiny-org/tok", "t1", "pt")
    assert server.tm_state.model_names == [REPO] and server.tm_state.model_root == REPO


class _RecordingClient(CoreProcessClient):
    """Records the config the engine process would be started on, and starts none."""

    launched: EngineConfig | None = None

    def launch(self, config: EngineConfig) -> None:
        self.launched = config

    async def wait_until_ready(self, ready_timeout_s: float) -> None:
        raise RuntimeError("no engine process in this test")


def test_the_engine_process_gets_the_revision_pinned_to_the_resolved_commit(cached_repo):
    config = EngineConfig(model=ModelConfig(model=REPO, revision="main"), device="cpu")
    client = _RecordingClient(config)
    engine = AsyncEngine(config, client=client)

    async def start() -> None:
        try:
            with pytest.raises(RuntimeError, match="no engine process"):
                await engine.start()
        finally:
            await engine.shutdown()

    asyncio.run(start())
    assert client.launched is not None and client.launched.model.revision == MAIN
    assert client.launched.model.model == REPO


def test_serving_a_hub_id_keeps_the_api_process_torch_free(cached_repo):
    # A real engine process: it inherits HF_HOME and HF_HUB_OFFLINE and finds the pinned snapshot.
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert _engine_side_modules_after(SERVE_ONE_REQUEST, REPO) == []
