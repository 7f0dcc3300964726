"""Commands that load a model in their own process (generate, chat, bench throughput / latency)
report what the user can fix as one line and exit code 2, as serve does, not as a traceback."""

from __future__ import annotations

import pytest

from tokenmill import cli


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["generate", "hi", "--model", "/no/such/model"],
            "tokenmill generate: error: model '/no/such/model' not found",
        ),
        (["chat", "--model", "/no/such/model"], "tokenmill chat: error: model '/no/such/model' not found"),
        (
            ["bench", "latency", "--model", "/no/such/model"],
            "tokenmill bench latency: error: model '/no/such/model'",
        ),
        (["bench", "throughput", "--model", "/no/such/model"], "tokenmill bench throughput: error: model"),
        (["generate", "hi", "--model", "Org/not-cached", "--device", "cpu"], "not found in the local cache"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(argv, expected, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


def test_bench_commands_exit_0_not_their_result(monkeypatch) -> None:
    """bench's main functions return the result they wrote; the command's exit code is 0."""
    from tokenmill.bench import latency

    monkeypatch.setattr(latency, "main", lambda args: {"metrics": {"tok_per_s": 1.0}})
    assert cli.main(["bench", "latency", "--model", "/unused"]) == 0
