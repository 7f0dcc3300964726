"""`tokenmill serve`'s flags reach what they configure (engine config, server state, uvicorn), and
bad values are refused at parse time naming the flag. Nothing is started: build_server only builds."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.cli import build_parser
from tokenmill.model.loader.default_model import DEFAULT_MODEL_NAME
from tokenmill.server.api_server import build_server, run_server

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build(argv: list[str]):
    """(server, its engine config); the engine's private socket directory is removed again."""
    server = build_server(build_parser().parse_args(["serve", "--device", "cpu", *argv]))
    asyncio.run(server.tm_state.engine.shutdown())
    return server, server.tm_state.engine.config


def test_no_arguments_serve_the_default_model_on_loopback_port_8000(monkeypatch):
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    server, config = build([])
    state = server.tm_state
    assert (server.config.host, server.config.port) == ("127.0.0.1", 8000)
    assert config.model.model is None and state.model_names == [DEFAULT_MODEL_NAME]
    assert config.cache.enable_prefix_caching and state.api_keys == ()
    assert config.kernel.cpu_weight_packing and config.kernel.cpu_quantized_gemv
    assert server.shutdown_timeout == 30.0


def test_every_flag_reaches_what_it_configures(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENMILL_API_KEY", raising=False)
    template_file = tmp_path / "template.jinja"
    template_file.write_text(TEMPLATE)
    server, config = build(
        [
            "/models/m", "--host", "0.0.0.0", "--port", "8123", "--served-model-name", "a, b",
            "--api-key", "k3y", "--max-model-len", "512", "--max-num-seqs", "7",
            "--max-num-batched-tokens", "99", "--num-kv-blocks", "33", "--kv-cache-memory", "2GiB",
            "--gpu-memory-utilization", "0.5", "--no-enable-prefix-caching", "--load-format", "dummy",
            "--dtype", "bfloat16", "--seed", "11", "--chat-template", str(template_file),
            "--shutdown-timeout", "4.5", "--max-num-waiting-seqs", "5", "--max-num-waiting-tokens", "600",
            "--request-timeout", "12", "--max-queue-time", "3", "--max-n", "6", "--max-body-bytes", "1000",
            "--max-header-bytes", "2000", "--client-read-timeout", "7", "--engine-hang-timeout", "9",
            "--enable-debug-endpoints", "--keep-alive-timeout", "2", "--stream-write-timeout", "8",
            "--no-cpu-weight-packing", "--no-cpu-quantized-gemv",
        ]
    )  # fmt: skip
    state = server.tm_state
    assert (server.config.host, server.config.port) == ("0.0.0.0", 8123)
    assert state.model_names == ["a", "b"] and state.model_root == "/models/m"
    assert state.metrics.model_name == "a" and state.api_keys == ("k3y",)
    assert config.model.model == "/models/m" and config.model.max_model_len == 512
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (7, 99)
    assert (config.cache.num_kv_blocks, config.cache.kv_cache_memory) == (33, 2 * 2**30)
    assert config.cache.gpu_memory_utilization == 0.5 and not config.cache.enable_prefix_caching
    assert (config.model.load_format, config.model.dtype, config.model.seed) == ("dummy", "bfloat16", 11)
    assert not config.kernel.cpu_weight_packing and not config.kernel.cpu_quantized_gemv
    assert config.model.chat_template == TEMPLATE  # read from the file
    assert server.shutdown_timeout == 4.5
    admission = state.admission
    assert (admission.max_num_waiting_seqs, admission.max_num_waiting_tokens) == (5, 600)
    assert (state.request_timeout, state.max_queue_time, state.max_n) == (12, 3, 6)
    assert (state.max_body_bytes, state.max_header_bytes, state.client_read_timeout) == (1000, 2000, 7)
    assert state.engine.hang_timeout_s == 9 and state.enable_debug_endpoints
    assert state.stream_write_timeout == 8
    assert server.config.timeout_keep_alive == 2 and server.config.h11_max_incomplete_event_size == 2000
    assert server.config.http.header_timeout_s == 7  # type: ignore[union-attr]  # stalled headers
    # A template given inline is taken as is; the key may come from the environment.
    monkeypatch.setenv("TOKENMILL_API_KEY", "from-env")
    server, config = build(["--chat-template", TEMPLATE, "--enable-prefix-caching"])
    assert config.model.chat_template == TEMPLATE and config.cache.enable_prefix_caching
    assert server.tm_state.api_keys == ("from-env",)
    # `tokenmill serve MODEL` and `--model MODEL` are the same; the same model twice is fine too.
    for argv in (["/models/x"], ["--model", "/models/x"], ["/models/x", "--model", "/models/x"]):
        server, config = build(argv)
        assert config.model.model == "/models/x" and server.tm_state.model_names == ["/models/x"]


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--port", "70000", "between 1 and 65535"),
        ("--max-n", "0", "between 1 and 64"),
        ("--max-n", "65", "between 1 and 64"),
        ("--max-num-waiting-seqs", "0", "at least 1"),
        ("--max-num-waiting-tokens", "-5", "at least 1"),
        ("--max-body-bytes", "lots", "must be an integer"),
        ("--max-header-bytes", "0", "at least 1"),
        ("--request-timeout", "0", "more than 0"),
        ("--max-queue-time", "-1", "more than 0"),
        ("--client-read-timeout", "nan", "more than 0"),
        ("--keep-alive-timeout", "inf", "more than 0"),
        ("--shutdown-timeout", "-1", "0 or more"),
        ("--stream-write-timeout", "-2", "0 or more"),
        ("--engine-hang-timeout", "0.5", "at least 1"),
    ],
)
def test_bad_server_flags_are_refused_naming_the_flag(flag, value, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and expected in err and repr(value) in err, err


def test_shutdown_timeout_zero_is_allowed():
    assert build_parser().parse_args(["serve", "--shutdown-timeout", "0"]).shutdown_timeout == 0


def test_stream_write_timeout_defaults_to_two_minutes_and_zero_disables_it():
    server, _ = build([])
    assert server.tm_state.stream_write_timeout == 120
    server, _ = build(["--stream-write-timeout", "0"])
    assert server.tm_state.stream_write_timeout is None


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization must be in (0, 1]"),
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
        (["--chat-template", "no-such-file.jinja"], "neither a Jinja template nor an existing file"),
        (["/models/a", "--model", "/models/b"], "given twice, '/models/a' and --model '/models/b'"),
    ],
)
def test_bad_engine_flags_end_serve_with_a_message_before_anything_starts(argv, expected, capsys):
    args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
    assert run_server(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenmill serve: error: ") and expected in err, err
