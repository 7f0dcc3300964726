"""Several API server processes export the whole server's metrics (prometheus_client's multiprocess
mode, metrics_multiprocess.py): request observations summed over the processes, the engine's
numbers counted once, and the same families and series as one process with every observation.

Multiprocess mode is process-global, so each "API server process" here is a subprocess running
WORKER; they share a directory under tmp_path. The API processes stay alive (as in a server) while
another one renders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

SRC = Path(__file__).resolve().parents[2] / "src"
MODEL = "smol"

# argv[1]: a JSON job. mode "multi" (enable multiprocess mode in job["dir"]) or "single"; with
# "wait", print READY after the observations and stay alive until stdin closes; with "render",
# print the /metrics text.
WORKER = r"""
import asyncio, json, sys

job = json.loads(sys.argv[1])
if job["mode"] == "multi":
    from tokenmill.metrics_multiprocess import enable_multiprocess_metrics
    enable_multiprocess_metrics(job["dir"])
import tokenmill.server.lora_registry as lora_registry
from tokenmill.metrics import ServerMetrics

kwargs = {}
if job["mode"] == "multi":
    kwargs = {"multiprocess_dir": job["dir"], "engine_stats_owner": job["owner"]}
m = ServerMetrics("smol", **kwargs)
m.set_kv_transfer("kv_producer", "10.0.0.1:14579")
m.info.set_cache_config(block_size=16, num_gpu_blocks=100, cache_dtype="auto")

# A LoRA registry serving two adapters, wired as the server wires it (server/state.py); the adapter
# files are not read (no engine, no weights).
class Engine:
    async def call_utility(self, method, timeout_s=30.0, args=None):
        return {}

lora_registry.read_adapter = lambda *args: None
lora = lora_registry.LoRARegistry(max_lora_rank=16, base_names=["smol"])
lora.arch = object()
adapters = {name: asyncio.run(lora.load(Engine(), name, "/adapters/" + name)) for name in ("ada", "idle")}
m.info.set_lora_load(lambda: {a.request.lora_name: lora.num_holding(a.request.lora_name) for a in lora.adapters}, 4)
lora.on_holds_changed = m.on_lora_holds_changed

plan = job["plan"]
for ttft in plan["ttft"]:
    m.on_first_token(ttft)
for gap in plan["itl"]:
    m.on_token_gap(gap)
for args in plan["finished"]:
    m.on_request_finished(*args)
for reason in plan["rejected"]:
    m.on_request_rejected(reason)
for n, max_tokens in plan["params"]:
    m.on_request_params(n, max_tokens)
holds = {}
for name in plan["holds"]:
    holds.setdefault(name, []).append(lora.hold(adapters[name]))
for name in plan["releases"]:
    holds[name].pop().release()
for stats in job["engine_stats"]:
    m.update_engine_stats(stats)
if job.get("render"):
    sys.stdout.write(m.render().decode())
if job.get("wait"):
    print("READY", flush=True)
    sys.stdin.read()
"""

# Two API server processes' own observations: different, so a sum can be told from either one.
PLAN_A = {
    "ttft": [0.03, 0.2],
    "itl": [0.004, 0.012, 0.012, 0.3],
    "finished": [["stop", 10, 4, 0.5, 0.05, 0.03], ["stop", 7, 2, 0.9, 0.1, 0.2]],
    "rejected": ["queue_full"],
    "params": [[1, 64], [1, 128]],
    "holds": ["ada", "ada", "ada"],
    "releases": ["ada"],
}
PLAN_B = {
    "ttft": [1.5],
    "itl": [0.004, 0.06],
    "finished": [["length", 3, 16, 2.0, 0.2, 1.5]],
    "rejected": ["queue_full", "invalid"],
    "params": [[2, 16]],
    "holds": ["ada", "idle"],
    "releases": ["idle"],
}
EMPTY_PLAN = {key: [] for key in PLAN_A}
# The same engine reports reach every process: absolute totals, gauges and engine-kept histograms.
ENGINE_STATS = [
    {
        "num_running": 2, "num_waiting": 1, "kv_cache_usage": 0.5, "prefix_cache_queries": 40,
        "prefix_cache_hits": 10, "num_preemptions_total": 1, "slo_goodput_requests": 2,
        "slo_attained_requests.default": 2, "kv_offload_hits": 8, "kv_offload_bytes": 4096,
    },
    {
        "num_running": 3, "num_waiting": 0, "kv_cache_usage": 0.25, "prefix_cache_queries": 100,
        "prefix_cache_hits": 30, "num_preemptions_total": 1, "slo_goodput_requests": 5,
        "slo_attained_requests.default": 5, "slo_missed_requests.default": 1,
        "spec_decode_num_drafts": 6, "spec_decode_num_accepted_tokens_per_pos.0": 4,
        "kv_offload_hits": 24, "kv_offload_bytes": 2048,
        "iteration_tokens_total_count": 2, "iteration_tokens_total_sum": 17,
        "iteration_tokens_total_bucket_le_1.0": 1, "iteration_tokens_total_bucket_le_16.0": 2,
    },
]  # fmt: skip

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.lower() != "prometheus_multiproc_dir"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    return env


def _run(job: dict) -> str:
    done = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(job)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _parse(text: str) -> tuple[Series, dict[str, str]]:
    """Every series' value, and each family's type (families without series included)."""
    series: Series = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in series, f"series exported twice: {key}"
            series[key] = s.value
    return series, types


def _serve_and_scrape(directory: Path, owners: tuple[bool, bool]) -> str:
    """Two API processes observe PLAN_A and PLAN_B and stay alive; a third (not the engine stats
    owner) takes the same engine stats and renders /metrics."""
    common = {"mode": "multi", "dir": str(directory), "engine_stats": ENGINE_STATS}
    alive = []
    try:
        for plan, owner in zip((PLAN_A, PLAN_B), owners, strict=True):
            job = {**common, "owner": owner, "plan": plan, "wait": True}
            proc = subprocess.Popen(
                [sys.executable, "-c", WORKER, json.dumps(job)],
                env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            alive.append(proc)
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line == "READY\n", proc.stderr.read() if proc.stderr else line
        return _run({**common, "owner": False, "plan": EMPTY_PLAN, "render": True})
    finally:
        for proc in alive:
            proc.communicate(timeout=30)  # closes stdin: the process ends


def _value(series: Series, name: str, **labels: str) -> float:
    return series[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> tuple[Series, dict[str, str]]:
    return _parse(_serve_and_scrape(tmp_path_factory.mktemp("metrics"), owners=(True, False)))


@pytest.fixture
def scraped(scrape: tuple[Series, dict[str, str]]) -> Series:
    return scrape[0]


def test_request_observations_are_summed_over_the_processes(scraped: Series) -> None:
    v = lambda name, **labels: _value(scraped, "tokenmill:" + name, **labels)  # noqa: E731
    assert v("request_success_total", finished_reason="stop") == 2
    assert v("request_success_total", finished_reason="length") == 1
    assert v("request_rejected_total", reason="queue_full") == 2
    assert v("request_rejected_total", reason="invalid") == 1
    assert v("prompt_tokens_total") == 10 + 7 + 3
    assert v("generation_tokens_total") == 4 + 2 + 16
    # TTFT 0.03 and 0.2 (A), 1.5 (B): bucket counts are cumulative over both processes.
    assert v("time_to_first_token_seconds_bucket", le="0.04") == 1
    assert v("time_to_first_token_seconds_bucket", le="0.25") == 2
    assert v("time_to_first_token_seconds_bucket", le="2.5") == 3
    assert v("time_to_first_token_seconds_count") == 3
    assert v("time_to_first_token_seconds_sum") == pytest.approx(0.03 + 0.2 + 1.5)
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert v(name + "_bucket", le="0.005") == 2  # 0.004 from each process
        assert v(name + "_bucket", le="0.015") == 4
        assert v(name + "_bucket", le="0.075") == 5
        assert v(name + "_bucket", le="+Inf") == 6
        assert v(name + "_count") == 6
        assert v(name + "_sum") == pytest.approx(0.004 + 0.012 + 0.012 + 0.3 + 0.004 + 0.06)
    assert v("request_params_n_count") == 3 and v("request_params_n_sum") == 4
    assert v("request_params_max_tokens_sum") == 64 + 128 + 16
    assert v("e2e_request_latency_seconds_count") == 3


def test_engine_numbers_are_counted_once(scraped: Series) -> None:
    v = lambda name, **labels: _value(scraped, "tokenmill:" + name, **labels)  # noqa: E731
    assert v("prefix_cache_queries_total") == 100 and v("prefix_cache_hits_total") == 30
    assert v("num_preemptions_total") == 1
    assert v("spec_decode_num_drafts_total") == 6
    assert v("spec_decode_num_accepted_tokens_per_pos_total", position="0") == 4
    assert v("kv_offload_hits_total") == 24
    assert v("num_requests_running") == 3 and v("num_requests_waiting") == 0
    assert v("kv_cache_usage_perc") == 0.25 and v("kv_offload_bytes") == 2048
    assert v("goodput_requests_total") == 5
    assert v("slo_attained_requests_total", slo_class="default") == 5
    assert v("slo_missed_requests_total", slo_class="default") == 1
    # Kept by the engine and rendered by the process scraped, as reported.
    assert v("iteration_tokens_total_count") == 2 and v("iteration_tokens_total_sum") == 17
    assert v("kv_transfer_info", kv_role="kv_producer", kv_transfer_address="10.0.0.1:14579") == 1
    # Gauges in an aggregating mode: no per-process series (prometheus_client's default adds a pid).
    assert not any(key == "pid" for (_, labels) in scraped for key, _ in labels)


def test_lora_requests_in_flight_are_summed(scraped: Series) -> None:
    # A holds ada 3 times and gives one back; B holds ada and idle, and gives idle back.
    in_flight = {
        dict(labels)["lora_name"]: value
        for (name, labels), value in scraped.items()
        if name == "tokenmill:lora_requests_in_flight"
    }
    assert in_flight == {"ada": 3.0, "idle": 0.0}
    (info,) = [dict(labels) for (name, labels) in scraped if name == "tokenmill:lora_requests_info"]
    assert info["running_lora_adapters"] == "ada" and info["max_lora"] == "4"
    (cache,) = [dict(labels) for (name, labels) in scraped if name == "tokenmill:cache_config_info"]
    assert cache["block_size"] == "16"


def test_two_owners_would_count_the_engine_twice(tmp_path: Path) -> None:
    """The control for test_engine_numbers_are_counted_once: the same scenario with both API
    processes feeding engine stats doubles the engine's counters, so those checks can fail."""
    series = _parse(_serve_and_scrape(tmp_path, owners=(True, True)))[0]
    assert _value(series, "tokenmill:prefix_cache_queries_total") == 200
    assert _value(series, "tokenmill:goodput_requests_total") == 10
    assert _value(series, "tokenmill:num_requests_running") == 3  # gauges: the largest, not the sum


def test_same_families_and_series_as_one_process_with_every_observation(
    scrape: tuple[Series, dict[str, str]],
) -> None:
    combined = {key: PLAN_A[key] + PLAN_B[key] for key in PLAN_A}
    single, single_types = _parse(
        _run({"mode": "single", "plan": combined, "engine_stats": ENGINE_STATS, "render": True})
    )
    multi, multi_types = scrape
    # The families with their types, including ones without series (speculative decoding's
    # draft-token counter, never reported here).
    assert multi_types == single_types
    assert "tokenmill:spec_decode_num_draft_tokens" in multi_types
    assert set(multi) == set(single)
    for key, value in single.items():
        if key[0] != "tokenmill:lora_requests_info":  # its value is the time of the scrape
            assert multi[key] == pytest.approx(value), key


def _run_code(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=env or _env(), capture_output=True, text=True, timeout=60
    )


def test_enable_is_idempotent_for_one_directory_and_refuses_another(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    done = _run_code(f"""
from prometheus_client import values
from tokenmill.metrics_multiprocess import enable_multiprocess_metrics, multiprocess_metrics_dir
assert multiprocess_metrics_dir() is None
enable_multiprocess_metrics({str(a)!r})
first = values.ValueClass
enable_multiprocess_metrics({str(a)!r})
assert values.ValueClass is first and first._multiprocess
assert multiprocess_metrics_dir() == {str(a)!r}
try:
    enable_multiprocess_metrics({str(b)!r})
except RuntimeError as exc:
    print(exc)
else:
    raise SystemExit("no error")
""")
    assert done.returncode == 0, done.stderr
    assert str(a) in done.stdout and str(b) in done.stdout


def test_enable_refuses_a_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    done = _run_code(f"""
from tokenmill.metrics_multiprocess import enable_multiprocess_metrics, multiprocess_metrics_dir
try:
    enable_multiprocess_metrics({str(missing)!r})
except RuntimeError as exc:
    print(exc)
else:
    raise SystemExit("no error")
assert multiprocess_metrics_dir() is None
""")
    assert done.returncode == 0, done.stderr
    assert str(missing) in done.stdout


def test_enable_keeps_an_inherited_mode_for_the_same_directory_only(tmp_path: Path) -> None:
    """prometheus_client imported with PROMETHEUS_MULTIPROC_DIR set already runs in multiprocess
    mode: its value class is kept for that directory and another directory is refused."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    code = """
import sys
from prometheus_client import values
from tokenmill.metrics_multiprocess import enable_multiprocess_metrics
inherited = values.ValueClass
assert inherited._multiprocess
try:
    enable_multiprocess_metrics(sys.argv[1])
except RuntimeError as exc:
    print("refused:", exc)
else:
    assert values.ValueClass is inherited
    print("kept")
"""
    env = {**_env(), "PROMETHEUS_MULTIPROC_DIR": str(a)}
    same = subprocess.run(
        [sys.executable, "-c", code, str(a)], env=env, capture_output=True, text=True, timeout=60
    )
    assert same.returncode == 0 and same.stdout.strip() == "kept", same.stderr
    other = subprocess.run(
        [sys.executable, "-c", code, str(b)], env=env, capture_output=True, text=True, timeout=60
    )
    assert other.returncode == 0 and other.stdout.startswith("refused:"), other.stderr
    assert str(a) in other.stdout and str(b) in other.stdout


def test_server_metrics_need_the_enabled_directory(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    done = _run_code(f"""
from tokenmill.metrics import ServerMetrics
from tokenmill.metrics_multiprocess import enable_multiprocess_metrics
for step in ("not enabled", "another directory"):
    try:
        ServerMetrics("smol", multiprocess_dir={str(b)!r})
    except RuntimeError as exc:
        print(step, "|", exc)
    else:
        raise SystemExit("no error: " + step)
    enable_multiprocess_metrics({str(a)!r})
try:  # one-process metrics would write to the shared files all the same
    ServerMetrics("smol")
except RuntimeError as exc:
    print("default |", exc)
else:
    raise SystemExit("no error: default")
ServerMetrics("smol", multiprocess_dir={str(a)!r}, engine_stats_owner=False)
""")
    assert done.returncode == 0, done.stderr
    not_enabled, other, default = done.stdout.splitlines()
    assert not_enabled.startswith("not enabled |") and "not enabled" in not_enabled.split("|")[1]
    assert other.startswith("another directory |") and str(a) in other and str(b) in other
    assert default.startswith("default |") and str(a) in default


def test_only_multiprocess_mode_has_a_non_owner() -> None:
    from tokenmill.metrics import ServerMetrics

    with pytest.raises(ValueError, match="multiprocess_dir"):
        ServerMetrics(MODEL, engine_stats_owner=False)
