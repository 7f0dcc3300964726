"""The API server process imports neither torch nor the model code: the engine-core process does.

Checked in fresh interpreters (this test process has imported torch long ago): one serves a
request through the app over a real engine process; one builds the server the way `tokenmill
serve` does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Never imported by the API server process, nor anything under them.
ENGINE_SIDE_MODULES = (
    "torch",
    "tokenmill.device",
    "tokenmill.model.llama",
    "tokenmill.model.layers",
    "tokenmill.model.registry",
    "tokenmill.worker",
    "tokenmill.attention",
    "tokenmill.kernels",
    "tokenmill.sample",
)

_FIND_ENGINE_SIDE_MODULES = f"""
def engine_side_modules():
    import sys
    names = {ENGINE_SIDE_MODULES!r}
    return sorted(m for m in sys.modules if any(m == n or m.startswith(n + ".") for n in names))
"""

SERVE_ONE_REQUEST = (
    _FIND_ENGINE_SIDE_MODULES
    + """
import asyncio, json, sys

import httpx

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.metrics import ServerMetrics
from tokenmill.server.api_server import create_app
from tokenmill.server.state import ServerState


async def main() -> None:
    model = sys.argv[1]
    config = EngineConfig(
        model=ModelConfig(model=model, max_model_len=64), cache=CacheConfig(num_kv_blocks=64), device="cpu"
    )
    state = ServerState(engine=AsyncEngine(config), model_names=["tiny"], model_root=model, metrics=ServerMetrics("tiny"))
    app = create_app(state)
    try:
        await state.engine.start()
        state.attach_engine()
        state.ready = True
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "def return", "max_tokens": 3})
            assert r.status_code == 200, r.text
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert r.status_code in (200, 400), r.text  # the tiny tokenizer may have no chat template
    finally:
        await state.engine.shutdown()
    print(json.dumps(engine_side_modules()))


asyncio.run(main())
"""
)

BUILD_SERVER = (
    _FIND_ENGINE_SIDE_MODULES
    + """
import asyncio, json, sys

from tokenmill.cli import build_parser
from tokenmill.server.launch import build_server

server = build_server(build_parser().parse_args(["serve", sys.argv[1], "--device", "cpu"]))
asyncio.run(server.tm_state.engine.shutdown())
print(json.dumps(engine_side_modules()))
"""
)


def _engine_side_modules_after(script: str, model: Path) -> list[str]:
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", script, str(model)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_serving_a_request_imports_no_torch_and_no_model_code_in_the_api_process(tiny_llama_dir):
    assert _engine_side_modules_after(SERVE_ONE_REQUEST, tiny_llama_dir) == []


def test_building_the_server_as_serve_does_imports_no_torch(tiny_llama_dir):
    assert _engine_side_modules_after(BUILD_SERVER, tiny_llama_dir) == []
