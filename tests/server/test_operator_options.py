"""Operator options of `tokenmill serve`: several API keys and --api-key-file, /version without a
key, CORS, TLS files, --root-path and `tokenmill --version`."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from tests.server.fake_engine import serve_over_fake_engine
from tests.server.test_serve_args import build
from tokenmill import __version__
from tokenmill.server.operator_options import CorsOptions


def _client_run(scenario, **state_kwargs) -> None:
    serve_over_fake_engine(lambda client, _state, _engine: scenario(client), timeout=10, **state_kwargs)


def test_several_keys_from_flags_and_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nk3\n\n  k4  \nk1\n")
    server, _ = build(["--api-key", "k1", "k2", "--api-key-file", str(key_file)])
    assert server.tm_state.api_keys == ("k1", "k2", "k3", "k4")
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    for path, message in ((empty, "holds no key"), (tmp_path / "missing", "missing")):
        with pytest.raises(ValueError, match=message):
            build(["--api-key-file", str(path)])
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    server, _ = build([])
    assert server.tm_state.api_keys == ("from-env",)


def test_each_key_opens_the_api_and_version_needs_none():
    async def scenario(client: httpx.AsyncClient) -> None:
        for key in ("alpha", "beta"):
            response = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200, key
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer gamma"})).status_code == 401
        assert (await client.get("/v1/models")).status_code == 401
        version = await client.get("/version")
        assert version.status_code == 200 and version.json()["version"] == __version__

    _client_run(scenario, api_keys=("alpha", "beta"))


def test_cors_preflight_and_headers_only_when_configured():
    origin = "https://app.example"
    cors = CorsOptions((origin,), ("*",), ("*",), False)

    async def with_cors(client: httpx.AsyncClient) -> None:
        preflight = await client.options(
            "/v1/chat/completions",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"},
        )  # no API key: a browser's preflight never carries one
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == origin
        other = await client.options(
            "/v1/models", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"}
        )
        assert "access-control-allow-origin" not in other.headers
        response = await client.get("/v1/models", headers={"Origin": origin, "Authorization": "Bearer k"})
        assert response.status_code == 200 and response.headers["access-control-allow-origin"] == origin

    async def without_cors(client: httpx.AsyncClient) -> None:
        response = await client.get("/v1/models", headers={"Origin": origin})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers

    _client_run(with_cors, api_keys=("k",), cors=cors)
    _client_run(without_cors)


def test_cors_flags_are_checked(monkeypatch):
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    server, _ = build(["--allowed-origins", '["https://a.example"]', "--allow-credentials"])
    assert server.tm_state.cors == CorsOptions(("https://a.example",), ("*",), ("*",), True)
    with pytest.raises(ValueError, match="needs --allowed-origins"):
        build(["--allow-credentials"])
    with pytest.raises(ValueError, match="list the origins"):
        build(["--allowed-origins", '["*"]', "--allow-credentials"])
    with pytest.raises(SystemExit):
        build(["--allowed-origins", "https://a.example"])  # not a JSON list


def test_root_path_reaches_the_openapi_servers():
    async def scenario(client: httpx.AsyncClient) -> None:
        assert (await client.get("/v1/models")).status_code == 200  # the proxy stripped the prefix
        schema = (await client.get("/openapi.json")).json()
        assert schema["servers"] == [{"url": "/api/tokenmill"}]

    _client_run(scenario, root_path="/api/tokenmill")


def test_tls_files_reach_uvicorn(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    server, _ = build(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)])
    server.config.load()  # builds the SSL context from the files: a bad pair raises here
    assert server.config.is_ssl and server.config.ssl is not None
    with pytest.raises(ValueError, match="go together"):
        build(["--ssl-keyfile", str(key)])
    with pytest.raises(ValueError, match="no such file"):
        build(["--ssl-keyfile", str(key), "--ssl-certfile", str(tmp_path / "nope.pem")])


def test_tokenmill_version():
    result = subprocess.run([sys.executable, "-m", "tokenmill.cli", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == f"tokenmill {__version__}"


def test_served_model_names_space_or_comma_separated(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    for argv in (["--served-model-name", "a", "b"], ["--served-model-name", "a, b"], ["--served-model-name", "a", "b,c"]):
        server, config = build(["/models/m", *argv])
        assert server.tm_state.model_names[:2] == ["a", "b"], argv
        assert config.model.served_model_name == "a"
    config_file = tmp_path / "serve.yaml"
    config_file.write_text("served-model-name: [x, y]\n")
    server, _ = build(["/models/m", "--config", str(config_file)])
    assert server.tm_state.model_names == ["x", "y"]


def test_access_log_on_by_default(monkeypatch):
    import logging

    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    server, _ = build([])
    assert server.config.access_log and logging.getLogger("uvicorn.access").isEnabledFor(logging.INFO)
    server, _ = build(["--disable-uvicorn-access-log"])
    assert not server.config.access_log


def test_log_level_reaches_the_engine_process(monkeypatch):
    """The engine process is started with the API server's level (--log-level DEBUG shows its debug lines)."""
    import logging

    from tokenmill.engine import core_process_client

    seen = {}

    class Stop(Exception):
        pass

    def fake_popen(command, **kwargs):
        seen["command"] = command
        raise Stop

    monkeypatch.setattr(core_process_client.subprocess, "Popen", fake_popen)
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.DEBUG)
    with pytest.raises(Stop):
        core_process_client._spawn_engine_process(None, [("ipc:///x", "ipc:///y")])  # type: ignore[arg-type]
    command = seen["command"]
    assert command[command.index("--log-level") + 1] == "DEBUG"
