"""Every script in benchmarks/ imports and answers --help on a machine without a GPU.

They only run on a GPU (or, cpu_weight_packing_ab, for minutes), so CI cannot run them; this keeps
them from rotting when the modules they import move. One subprocess runs them all: torch imports once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tokenmill

ROOT = Path(tokenmill.__file__).parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))

_RUN_EACH_WITH_HELP = """
import contextlib, io, runpy, sys
failures = []
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        failures.append(f"{path}: returned without printing help")
    except SystemExit as exc:
        if exc.code not in (0, None) or "usage:" not in out.getvalue():
            failures.append(f"{path}: exit {exc.code!r}, output {out.getvalue()[:200]!r}")
    except Exception as exc:
        failures.append(f"{path}: {type(exc).__name__}: {exc}")
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def test_the_benchmark_scripts_parse_help_on_the_cpu() -> None:
    assert SCRIPTS, "no scripts found in benchmarks/"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", _RUN_EACH_WITH_HELP, *map(str, SCRIPTS)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_the_shell_scripts_parse_and_the_speculation_one_answers_help() -> None:
    """Every benchmarks/*.sh is valid bash (`bash -n` runs nothing); spec_ngram_cpu.sh prints its
    usage for --help and starts no server (it returns at once)."""
    shell_scripts = sorted((ROOT / "benchmarks").glob("*.sh"))
    assert shell_scripts
    for path in shell_scripts:
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, f"{path.name}: {check.stderr}"
    script = ROOT / "benchmarks" / "spec_ngram_cpu.sh"
    result = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.startswith("usage:"), result.stdout + result.stderr
    assert "num_speculative_tokens" in result.stdout
    wrong = subprocess.run(["bash", str(script), "--port"], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert wrong.returncode == 2 and "takes no arguments" in wrong.stderr


def test_the_dummy_tokenizer_gives_every_id_visible_text_and_round_trips(tmp_path: Path) -> None:
    """benchmarks/make_dummy_tokenizer.py: serving benchmarks on random weights need every sampled
    id to stream text (else the client's first chunk, its TTFT, comes late)."""
    import importlib.util

    from transformers import AutoTokenizer

    from tokenmill.engine.detokenizer import IncrementalDetokenizer

    spec = importlib.util.spec_from_file_location("make_dummy_tokenizer", ROOT / "benchmarks/make_dummy_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenizer = AutoTokenizer.from_pretrained(module.write(tmp_path / "tok", 300))
    assert len(tokenizer) == 300 and tokenizer.all_special_ids == [0]
    ids = list(range(1, 300))
    assert tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False) == ids
    detokenizer = IncrementalDetokenizer(tokenizer, [5, 6])
    assert all(detokenizer.add_tokens([i]) for i in ids)


def test_the_serving_scripts_dummy_tokenizer_follows_the_model(tmp_path: Path) -> None:
    """`make_dummy_tokenizer.py --for-model`: the vocabulary of the model's config, written once
    and found again; only its path on stdout (the scripts read it)."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 321}')
    command = [sys.executable, "benchmarks/make_dummy_tokenizer.py", "--for-model", str(model), "--cache", str(tmp_path)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    path = Path(first.stdout.strip())
    assert path == tmp_path / "dummy-tokenizer-321" and (path / "tokenizer.json").is_file()
    stamp = (path / "tokenizer.json").stat().st_mtime_ns
    again = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT, check=True)
    assert again.stdout == first.stdout and (path / "tokenizer.json").stat().st_mtime_ns == stamp
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size() == 321
    wrong = subprocess.run(
        [sys.executable, "benchmarks/make_dummy_tokenizer.py"], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert wrong.returncode == 2 and "--for-model" in wrong.stderr
