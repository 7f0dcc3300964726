"""Multi-LoRA through the HTTP API (issue 18): a real `tokenmill serve` on the tiny Llama with PEFT
adapters made here, against transformers with each adapter merged; runtime load / unload, reloads
under one name, every bad input with its status; then the API against the scripted fake engine for
what a real model makes racy (an unload while a request is in flight) and for servers with LoRA or
runtime updating off."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.lora_adapters import greedy_tokens, merged_model, write_peft_adapter
from tests.server.fake_engine import MODEL, FakeEngine, fake_server_state, wait_until
from tests.server.server_process import free_port, start_server

KEY = "lora-k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
BASE = "tiny"
MAX_TOKENS = 10
# Over two KV blocks (16 tokens each), so a prefix-cache hit across adapter loads would show.
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat by the door"


# --------------------------------------------------------------------------- adapters


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Good adapters under allowed/, one outside it, and the bad ones (each named for its problem)."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("lora_adapters")
    allowed = root / "allowed"
    dirs = {
        "a": write_peft_adapter(tiny_llama_dir, allowed / "a", seed=21, r=8),
        "b": write_peft_adapter(tiny_llama_dir, allowed / "b", seed=22, r=4, targets=("q_proj", "v_proj", "down_proj")),
        "c": write_peft_adapter(tiny_llama_dir, allowed / "c", seed=23, r=16, alpha=8, use_rslora=True),
        "outside": write_peft_adapter(tiny_llama_dir, root / "outside", seed=24, r=4, targets=("q_proj",)),
        "rank32": write_peft_adapter(tiny_llama_dir, allowed / "rank32", seed=25, r=32, targets=("q_proj",)),
    }
    config = json.loads((dirs["a"] / "adapter_config.json").read_text())
    tensors = load_file(dirs["a"] / "adapter_model.safetensors")

    def variant(name: str, *, config_update: dict | None = None, tensors_of=None, weights: bytes | None = None) -> None:
        path = allowed / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps({**config, **(config_update or {})}))
        if weights is not None:
            (path / "adapter_model.safetensors").write_bytes(weights)
        elif tensors_of is not None:
            save_file(tensors_of(dict(tensors)), str(path / "adapter_model.safetensors"))
        dirs[name] = path

    def wrong_shape(t: dict) -> dict:
        name = next(n for n in t if "q_proj.lora_A" in n)
        t[name] = t[name][:, :32].copy()  # in_features 32: trained for a base with hidden size 32
        return t

    variant("shapes", tensors_of=wrong_shape)
    variant("targets", config_update={"target_modules": ["embed_tokens", "q_proj"]}, tensors_of=lambda t: t)
    variant("corrupt", weights=b"\x10\x00\x00\x00\x00\x00\x00\x00{not safetensors at all")
    variant("no_weights")
    (allowed / "escape").symlink_to(dirs["outside"], target_is_directory=True)  # inside, pointing out
    dirs["escape"] = allowed / "escape"
    dirs["allowed"] = allowed
    return dirs


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir, adapter_dirs):
    """Greedy tokens of PROMPT from transformers with the adapter merged (None: the base model)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(PROMPT).input_ids
    cache: dict[str | None, list[int]] = {}

    def tokens(name: str | None) -> list[int]:
        if name not in cache:
            model = merged_model(tiny_llama_dir, None if name is None else adapter_dirs[name])
            cache[name] = greedy_tokens(model, ids, MAX_TOKENS)
        return cache[name]

    tokens.prompt_ids = ids  # type: ignore[attr-defined]
    return tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir, adapter_dirs):
    proc = start_server(
        str(tmp_path_factory.mktemp("lora_server")),
        "--model", str(tiny_llama_dir), "--served-model-name", BASE, "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "128", "--num-kv-blocks", "256", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "16", "--max-cpu-loras", "3",
        "--lora-modules", f"alpha={adapter_dirs['a']}",
        json.dumps({"name": "beta", "path": str(adapter_dirs["b"]), "base_model_name": "tiny-base"}),
        "--allow-runtime-lora-updating", "--lora-allowed-dirs", str(adapter_dirs["allowed"]),
        "--api-key", KEY, "--enable-debug-endpoints",
    )  # fmt: skip
    yield proc
    proc.stop()


def complete(server, model: str, prompt_ids: list[int]) -> httpx.Response:
    body = {
        "model": model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 1, "return_tokens_as_token_ids": True,
    }  # fmt: skip
    return httpx.post(f"{server.base_url}/v1/completions", json=body, headers=AUTH, timeout=120)


def completion_tokens(server, model: str, prompt_ids: list[int]) -> list[int]:
    r = complete(server, model, prompt_ids)
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def load(server, name: str, path: Path | str, headers=AUTH) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body, headers=headers, timeout=60)


def unload(server, name: str, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, headers=headers, timeout=60)


def error_message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


# --------------------------------------------------------------------------- the real server


def test_start_up_adapters_equal_the_merged_oracle_and_differ_from_the_base(server, oracle):
    ids = oracle.prompt_ids
    base = completion_tokens(server, BASE, ids)
    assert base == oracle(None)
    assert completion_tokens(server, "alpha", ids) == oracle("a")
    assert completion_tokens(server, "beta", ids) == oracle("b")
    assert oracle("a") != oracle(None) and oracle("b") != oracle(None)  # the test can see the adapters
    # Chat picks adapters the same way; its text differs from the base model's.
    def chat(model: str) -> str:
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        return r.json()["choices"][0]["message"]["content"]

    assert chat("alpha") != chat(BASE)


def test_models_lists_the_adapters_with_their_parent(server, adapter_dirs):
    r = httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10)
    cards = {c["id"]: c for c in r.json()["data"]}
    assert set(cards) == {BASE, "alpha", "beta"}
    assert cards[BASE]["parent"] is None
    assert (cards["alpha"]["root"], cards["alpha"]["parent"]) == (str(adapter_dirs["a"]), BASE)
    assert (cards["beta"]["root"], cards["beta"]["parent"]) == (str(adapter_dirs["b"]), "tiny-base")


def test_unknown_model_is_404_naming_the_base_and_the_adapters(server, oracle):
    r = complete(server, "gamma", oracle.prompt_ids)
    assert r.status_code == 404
    message = error_message(r)
    assert "'gamma'" in message and BASE in message and "alpha" in message and "beta" in message


def test_runtime_load_use_unload_then_404(server, adapter_dirs, oracle):
    ids = oracle.prompt_ids
    r = load(server, "gamma", adapter_dirs["c"])
    assert r.status_code == 200, r.text
    assert completion_tokens(server, "gamma", ids) == oracle("c")
    models = httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert "gamma" in [c["id"] for c in models]
    r = unload(server, "gamma")
    assert r.status_code == 200, r.text
    assert complete(server, "gamma", ids).status_code == 404
    models = httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert "gamma" not in [c["id"] for c in models]


def test_a_reload_under_the_same_name_serves_the_new_adapter_not_the_old_cache(server, adapter_dirs, oracle):
    ids = oracle.prompt_ids
    assert oracle("b") != oracle("c")
    assert load(server, "swap", adapter_dirs["b"]).status_code == 200
    assert completion_tokens(server, "swap", ids) == oracle("b")
    assert completion_tokens(server, "swap", ids) == oracle("b")  # the second one hits the prefix cache
    assert unload(server, "swap").status_code == 200
    assert load(server, "swap", adapter_dirs["c"]).status_code == 200
    assert completion_tokens(server, "swap", ids) == oracle("c")
    assert unload(server, "swap").status_code == 200


@pytest.mark.parametrize(
    ("name", "status", "words"),
    [
        ("shapes", 400, ("lora_A", "another base model")),
        ("targets", 400, ("embed_tokens", "not supported")),
        ("rank32", 400, ("rank 32", "--max-lora-rank 16")),
        ("corrupt", 400, ("not a readable safetensors file",)),
        ("no_weights", 400, ("adapter_model.safetensors",)),
        ("outside", 403, ("--lora-allowed-dirs",)),
        ("escape", 403, ("--lora-allowed-dirs",)),
    ],
)
def test_a_bad_adapter_is_refused_naming_the_problem(server, adapter_dirs, name, status, words):
    r = load(server, f"bad-{name}", adapter_dirs[name])
    assert r.status_code == status, r.text
    message = error_message(r)
    assert all(w in message for w in words), message
    if status == 403:
        assert str(adapter_dirs["allowed"].resolve()) in message
    models = httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert f"bad-{name}" not in [c["id"] for c in models]


def test_other_bad_loads_and_unloads(server, adapter_dirs, tmp_path):
    r = load(server, "alpha", adapter_dirs["c"])
    assert r.status_code == 400 and "already loaded" in error_message(r)
    r = load(server, BASE, adapter_dirs["c"])
    assert r.status_code == 400 and "base model" in error_message(r)
    r = load(server, "missing", adapter_dirs["allowed"] / "nothing-here")
    assert r.status_code == 400 and "not a directory" in error_message(r)
    r = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "x"}, headers=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = unload(server, "never-loaded")
    assert r.status_code == 404 and "never-loaded" in error_message(r) and "alpha" in error_message(r)


def test_the_api_key_guards_the_lora_endpoints(server, adapter_dirs):
    wrong = {"Authorization": "Bearer nope"}
    assert load(server, "sneaky", adapter_dirs["c"], headers=wrong).status_code == 401
    assert load(server, "sneaky", adapter_dirs["c"], headers={}).status_code == 401
    assert unload(server, "alpha", headers={}).status_code == 401
    models = httpx.get(f"{server.base_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
    assert "sneaky" not in [c["id"] for c in models] and "alpha" in [c["id"] for c in models]


def test_zz_after_all_that_the_base_and_the_adapters_still_serve_and_nothing_leaked(server, oracle):
    """Runs last in this file (name order of pytest's collection within the module: definition order)."""
    ids = oracle.prompt_ids
    assert completion_tokens(server, BASE, ids) == oracle(None)
    assert completion_tokens(server, "alpha", ids) == oracle("a")
    assert completion_tokens(server, "beta", ids) == oracle("b")
    r = httpx.get(f"{server.base_url}/debug/invariants", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["ok"], r.text
    assert server.process.poll() is None


# --------------------------------------------------------------------------- start-up errors


def test_lora_flags_without_enable_lora_are_a_start_up_error_naming_the_flag(tmp_path):
    from tokenmill.cli import build_parser
    from tokenmill.server.launch import build_server

    for flags, named in (
        (["--lora-modules", f"a={tmp_path}"], "--lora-modules"),
        (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating"),
        (["--lora-allowed-dirs", str(tmp_path)], "--lora-allowed-dirs"),
    ):
        with pytest.raises(ValueError, match=f"{named} needs --enable-lora"):
            build_server(build_parser().parse_args(["serve", "--device", "cpu", *flags]))
    for bad, words in (
        ("nopath", "name=path"),
        ('{"name": "a"}', "JSON form"),
        ('{"name": "a", "path": "/x", "colour": 1}', "colour"),
    ):
        with pytest.raises(ValueError, match=words):
            build_server(build_parser().parse_args(["serve", "--device", "cpu", "--enable-lora", "--lora-modules", bad]))


def test_a_bad_start_up_adapter_stops_the_server_naming_it(tiny_llama_dir, adapter_dirs):
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(tiny_llama_dir), "--device", "cpu",
         "--port", str(free_port()), "--enable-lora", "--max-lora-rank", "16", "--lora-modules", f"big={adapter_dirs['rank32']}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "rank 32" in result.stderr and "--max-lora-rank" in result.stderr, result.stderr[-2000:]


def test_checking_an_adapter_imports_no_torch(tiny_llama_dir, adapter_dirs):
    """The API server checks adapters in its own process, which never imports torch."""
    script = (
        "import sys\n"
        "from tokenmill.config import ModelConfig\n"
        "from tokenmill.model.resolve import resolve_model\n"
        "from tokenmill.lora.adapter_files import read_adapter\n"
        "arch = resolve_model(ModelConfig(model=sys.argv[1])).arch\n"
        "read_adapter(sys.argv[2], arch, 16)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_llama_dir), str(adapter_dirs["a"])],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


# --------------------------------------------------------------------------- the fake engine


def run_fake(scenario, arch=None, **registry_kwargs) -> None:
    """`scenario(client, state, engine, utility_calls)` against the app over the fake engine, with a
    LoRA registry for `arch` (None: LoRA off)."""
    from tokenmill.server.api_server import create_app
    from tokenmill.server.lora_registry import LoRARegistry

    async def main() -> None:
        engine = FakeEngine()
        await engine.start()
        calls: list[tuple[str, dict | None]] = []
        call_utility = engine.call_utility

        async def recording(method: str, timeout_s: float = 30.0, args: dict | None = None) -> dict:
            calls.append((method, args))
            return await call_utility(method, timeout_s, args)

        engine.call_utility = recording  # type: ignore[method-assign]
        state = fake_server_state(engine)
        if arch is not None:
            state.lora = LoRARegistry(max_lora_rank=16, base_names=[MODEL], **registry_kwargs)
            state.lora.arch = arch
        transport = httpx.ASGITransport(app=create_app(state))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=10) as client:
                await asyncio.wait_for(scenario(client, state, engine, calls), 20)
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.fixture
def tiny_arch(tiny_llama_dir):
    from tokenmill.config import ModelConfig
    from tokenmill.model.resolve import resolve_model

    return resolve_model(ModelConfig(model=str(tiny_llama_dir))).arch


def test_unloading_an_adapter_in_use_is_409_until_its_requests_finish(tiny_arch, adapter_dirs):
    from tokenmill.lora.request import LoRARequest

    path = str(adapter_dirs["a"])

    async def scenario(client, state, engine, calls) -> None:
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "ad", "lora_path": path})
        assert r.status_code == 200, r.text
        assert calls[-1] == ("add_lora", {"lora_name": "ad", "lora_int_id": 1, "lora_path": path})
        engine.core.paused = True  # the request stays in flight
        request = asyncio.create_task(
            client.post("/v1/completions", json={"model": "ad", "prompt": "hi", "max_tokens": 3})
        )
        await wait_until(lambda: state.lora.num_holding("ad") == 1)
        await wait_until(lambda: len(engine.core.requests) == 1)
        assert engine.core.requests[0].lora_request == LoRARequest("ad", 1, path)
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "ad"})
        assert r.status_code == 409, r.text
        assert "finish or cancel them first" in r.json()["error"]["message"]
        assert not any(method == "remove_lora" for method, _ in calls)
        engine.core.paused = False  # it finishes ...
        assert (await request).status_code == 200
        assert state.lora.num_holding("ad") == 0
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "ad"})  # ... then the unload goes
        assert r.status_code == 200, r.text
        assert calls[-1] == ("remove_lora", {"lora_int_id": 1})
        # A reload under the same name gets a new id; base requests carry no adapter.
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "ad", "lora_path": path})
        assert r.status_code == 200 and calls[-1][1]["lora_int_id"] == 2
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and engine.core.requests[-1].lora_request is None

    run_fake(scenario, tiny_arch, allow_runtime_updating=True)


def test_an_aborted_request_releases_its_adapter(tiny_arch, adapter_dirs):
    async def scenario(client, state, engine, calls) -> None:
        body = {"lora_name": "ad", "lora_path": str(adapter_dirs["a"])}
        assert (await client.post("/v1/load_lora_adapter", json=body)).status_code == 200
        engine.core.paused = True
        body = {"model": "ad", "prompt": "hi", "max_tokens": 3, "stream": True}
        request = asyncio.create_task(client.post("/v1/completions", json=body))
        await wait_until(lambda: state.lora.num_holding("ad") == 1)
        request.cancel()  # the client leaves
        await asyncio.gather(request, return_exceptions=True)
        await wait_until(lambda: state.lora.num_holding("ad") == 0)
        assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "ad"})).status_code == 200

    run_fake(scenario, tiny_arch, allow_runtime_updating=True)


def test_runtime_updating_off_answers_404_naming_the_flag_and_hides_the_routes(tiny_arch):
    async def scenario(client, state, engine, calls) -> None:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            r = await client.post(path, json={"lora_name": "x", "lora_path": "/tmp"})
            assert r.status_code == 404 and "--allow-runtime-lora-updating" in r.json()["error"]["message"]
        schema = (await client.get("/openapi.json")).json()
        assert "/v1/load_lora_adapter" not in schema["paths"]
        assert "LoadLoRAAdapterRequest" not in schema["components"]["schemas"]
        assert calls == []

    run_fake(scenario, tiny_arch)


def test_lora_off_keeps_model_names_strict_and_names_enable_lora():
    async def scenario(client, state, engine, calls) -> None:
        r = await client.post("/v1/completions", json={"model": "some-adapter", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and "'some-adapter'" in r.json()["error"]["message"]
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"})
        assert r.status_code == 404 and "--enable-lora" in r.json()["error"]["message"]
        assert [c["id"] for c in (await client.get("/v1/models")).json()["data"]] == [MODEL]

    run_fake(scenario)


def test_runtime_updating_on_publishes_the_routes_with_their_bodies(tiny_arch):
    async def scenario(client, state, engine, calls) -> None:
        schema = (await client.get("/openapi.json")).json()
        for path, model in (
            ("/v1/load_lora_adapter", "LoadLoRAAdapterRequest"),
            ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest"),
        ):
            body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
            assert body == {"$ref": f"#/components/schemas/{model}"}
        assert schema["components"]["schemas"]["LoadLoRAAdapterRequest"]["required"] == ["lora_name", "lora_path"]

    run_fake(scenario, tiny_arch, allow_runtime_updating=True)


def test_start_up_adapters_on_every_api_server_process(tmp_path, tiny_llama_dir, adapter_dirs, oracle):
    """--api-server-count 2: the first process has the engine load --lora-modules, the second
    serves them under the same ids; each answers like the merged oracle, and /metrics (either
    process) counts the adapters' in-flight requests over both."""
    import concurrent.futures
    import re
    import time

    proc = start_server(
        str(tmp_path),
        "--model", str(tiny_llama_dir), "--served-model-name", BASE, "--device", "cpu", "--dtype", "float32",
        "--max-model-len", "128", "--num-kv-blocks", "256", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "16", "--lora-modules", f"alpha={adapter_dirs['a']}",
        json.dumps({"name": "beta", "path": str(adapter_dirs["b"]), "base_model_name": "tiny-base"}),
        "--api-key", KEY, "--api-server-count", "2", "--enable-log-requests",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "2 API server processes)" not in proc.log():
            assert proc.process.poll() is None and time.monotonic() < deadline, proc.log()
            time.sleep(0.2)
        ids = oracle.prompt_ids
        expected = {BASE: oracle(None), "alpha": oracle("a"), "beta": oracle("b")}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            for _ in range(6):  # until the second process has answered adapter requests too
                names = [BASE, "alpha", "beta"] * 3
                for name, tokens in zip(names, pool.map(lambda n: completion_tokens(proc, n, ids), names), strict=True):
                    assert tokens == expected[name], name
                if len(re.findall(r"\[api 1\] tokenmill\S*: Received request .*lora_request: (alpha|beta)", proc.log())) >= 2:
                    break
        assert re.search(r"\[api 1\] tokenmill\S*: Received request .*lora_request: (alpha|beta)", proc.log())
        for _ in range(4):  # whichever process answers
            models = httpx.get(f"{proc.base_url}/v1/models", headers=AUTH, timeout=10).json()["data"]
            assert {m["id"]: m.get("parent") for m in models} == {BASE: None, "alpha": BASE, "beta": "tiny-base"}
            text = httpx.get(f"{proc.base_url}/metrics", headers=AUTH, timeout=10).text
            assert 'tokenmill:lora_requests_in_flight{lora_name="alpha",model_name="tiny"} 0.0' in text
    finally:
        proc.stop()
