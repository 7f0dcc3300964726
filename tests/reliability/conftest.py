"""The one tiny-model server the fuzz and tenant tests share (started once: ~10 s on 2 cores)."""

from __future__ import annotations

import pytest

from tests.reliability.server_tools import start_tiny_server

SHARED_MODEL = "tiny"
SHARED_MAX_MODEL_LEN = 128  # bounds what any fuzzed request can cost


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory, tiny_llama_dir):
    proc = start_tiny_server(
        str(tmp_path_factory.mktemp("shared_server")),
        str(tiny_llama_dir),
        "--served-model-name", SHARED_MODEL,
        "--max-model-len", str(SHARED_MAX_MODEL_LEN),
        "--max-num-seqs", "16",
        "--num-kv-blocks", "512",
    )  # fmt: skip
    yield proc
    proc.stop()
