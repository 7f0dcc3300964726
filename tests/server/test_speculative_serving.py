"""`tokenmill serve --speculative-config`: the served default model with ngram speculation gives the
same greedy text as without it, streamed or not, and /metrics counts drafts with vLLM's names; a
bad config stops the server at start-up with the key named."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.server_process import start_server

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
PROMPT = (
    "Copy this list exactly, one item per line:\napple pie\nbanana bread\ncherry tart\n"
    "apple pie\nbanana bread\ncherry tart\n"
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, default_model_path):
    tmp = str(tmp_path_factory.mktemp("spec_server"))
    common = ("--max-model-len", "512", "--device", "cpu")
    # Both start at once: each start-up mostly waits (imports, model load, health polls), so two
    # side by side take little longer than one.
    with ThreadPoolExecutor(2) as pool:
        starts = [
            pool.submit(start_server, tmp, *common),
            pool.submit(start_server, tmp, *common, "--speculative-config", SPEC),
        ]
    started = [start.result() for start in starts if start.exception() is None]
    if len(started) < 2:
        for server in started:
            server.stop()
        next(start.result() for start in starts if start.exception() is not None)  # raises its error
    plain, speculative = started
    yield plain, speculative
    plain.stop()
    speculative.stop()


def _complete(server, stream: bool) -> str:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=48, temperature=0.0)
    if not stream:
        return client.completions.create(**kwargs).choices[0].text
    return "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **kwargs))


def test_greedy_text_is_unchanged_and_metrics_count_drafts(servers):
    plain, speculative = servers
    expected = _complete(plain, stream=False)
    assert _complete(speculative, stream=False) == expected
    assert _complete(speculative, stream=True) == expected
    metrics = httpx.get(f"{speculative.base_url}/metrics", timeout=10).text
    drafts = [line for line in metrics.splitlines() if line.startswith("tokenmill:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0, metrics[-2000:]
    assert 'tokenmill:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2-135M-Instruct",position="0"}' in metrics
    plain_metrics = httpx.get(f"{plain.base_url}/metrics", timeout=10).text
    assert "tokenmill:spec_decode_num_drafts_total{" not in plain_metrics


def test_a_bad_speculative_config_stops_the_server_naming_the_key():
    bad = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_maxx": 2})
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--speculative-config", bad, "--device", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "prompt_lookup_maxx" in result.stderr + result.stdout
