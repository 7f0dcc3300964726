"""Running test modules' Triton cases under the CPU interpreter in a subprocess.

TRITON_INTERPRET is read when triton is first imported, so a pytest process that imported it
compiled (any GPU-capable run, or an earlier module) cannot interpret kernels itself: such modules
have one test that reruns the module with TRITON_INTERPRET=1 in a fresh interpreter.

Each such module declares its run at import (`run = interpreted_run(__file__, "-k", "triton")`)
and its test calls `run.assert_passes()`. When the session has collected those tests,
`start_interpreted_runs` (tests/conftest.py, after collection) starts ONE subprocess for all of
them, in the background: the interpreter (single-threaded Python, given one thread) then uses the
CPU time the session leaves idle (servers starting, subprocesses awaited) instead of running
after it, and pays the interpreter's start, torch's and triton's imports once instead of once a
module. Each module's test waits for it and passes only if every one of that module's cases
passed. A test whose run was not started (it was not collected at start, e.g. `pytest FILE::test`
of a module imported by another) runs its module alone, as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# The subprocess's pytest loads this module as a plugin; this variable carries each module's -k.
_KEYWORDS_ENV = "TESTS_INTERPRETED_KEYWORDS"


@dataclass
class InterpretedRun:
    test_file: str
    pytest_args: tuple[str, ...]
    timeout: float
    _shared: _SharedRun | None = field(default=None, repr=False)

    @property
    def keyword(self) -> str | None:
        """The module's `-k` (the only argument these runs take)."""
        if not self.pytest_args:
            return None
        if len(self.pytest_args) != 2 or self.pytest_args[0] != "-k":
            raise ValueError(f"only '-k WORD' is supported, not {self.pytest_args}")
        return self.pytest_args[1]

    def assert_passes(self) -> None:
        """Fail with the module's failures (and the end of the output) unless every case passes."""
        if self._shared is None:
            assert_passes_interpreted(self.test_file, *self.pytest_args, timeout=self.timeout)
            return
        self._shared.assert_file_passes(self.test_file)


_RUNS: dict[str, InterpretedRun] = {}


def interpreted_run(test_file: str, *pytest_args: str, timeout: float = 300) -> InterpretedRun:
    """Declare `test_file`'s interpreted run (its pytest `-k`, if any, in `pytest_args`)."""
    run = InterpretedRun(str(Path(test_file).resolve()), pytest_args, timeout)
    run.keyword  # noqa: B018 - refuses arguments the shared run cannot pass on
    return _RUNS.setdefault(run.test_file, run)


def assert_passes_interpreted(test_file: str, *pytest_args: str, timeout: float = 300) -> None:
    """Run pytest on `test_file` (with `pytest_args`, e.g. "-k", "triton") in a subprocess with
    TRITON_INTERPRET=1; fail with the end of its output unless every case passes."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", *pytest_args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def _lowest_priority() -> None:
    os.nice(19)


class _SharedRun:
    """One pytest subprocess over several modules, each with its own -k, reporting to a JUnit XML."""

    def __init__(self, runs: list[InterpretedRun], rootdir: Path) -> None:
        self.files = [run.test_file for run in runs]
        # JUnit's classname of a case: its module's path under the rootdir, dotted.
        self._dotted = {
            file: ".".join(Path(os.path.relpath(file, rootdir)).with_suffix("").parts) for file in self.files
        }
        self.timeout = sum(run.timeout for run in runs)
        self._dir = tempfile.TemporaryDirectory(prefix="tokenmill-interpreted-")
        self.xml = Path(self._dir.name) / "report.xml"
        self._log = open(Path(self._dir.name) / "output.txt", "w+")  # noqa: SIM115 - closed in stop()
        keywords = {run.test_file: run.keyword for run in runs if run.keyword}
        env = {**os.environ, "TRITON_INTERPRET": "1", _KEYWORDS_ENV: json.dumps(keywords)}
        # One thread: the interpreter is single-threaded Python and the session keeps the other core.
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        command = [
            sys.executable, "-m", "pytest", *self.files, "-q", "-p", "no:cacheprovider",
            "-p", "tests.triton_interpreter", f"--junitxml={self.xml}",
        ]  # fmt: skip
        # Lowest priority (nice 19): it should take only the CPU the session leaves idle. At the
        # default priority it took one of the two cores while in-process engines ran torch on both,
        # and their steps waited on the descheduled thread (the first ~13 minutes of a 2-core run,
        # the engine tests, ran ~1.3-4x slower than alone).
        self.process = subprocess.Popen(
            command, cwd=rootdir, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=_lowest_priority if hasattr(os, "nice") else None,
        )  # fmt: skip
        self._started = time.monotonic()
        self._cases: dict[str, list[ET.Element]] | None = None

    def _wait(self) -> dict[str, list[ET.Element]]:
        if self._cases is None:
            try:
                self.process.wait(max(1.0, self.timeout - (time.monotonic() - self._started)))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(
                    f"the interpreted run took over {self.timeout:.0f} s:\n{self._output()}"
                ) from None
            cases: dict[str, list[ET.Element]] = {file: [] for file in self.files}
            if self.xml.exists():
                for case in ET.parse(self.xml).iter("testcase"):
                    file = self._file_of(case)
                    if file in cases:
                        cases[file].append(case)
            self._cases = cases
        return self._cases

    def _file_of(self, case: ET.Element) -> str | None:
        # classname is the module's dotted path ("tests.unit.test_x"), or "tests.unit.test_x.Class".
        classname = case.get("classname", "")
        for file, dotted in self._dotted.items():
            if classname == dotted or classname.startswith(dotted + "."):
                return file
        return None

    def _output(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read()[-4000:]

    def assert_file_passes(self, test_file: str) -> None:
        cases = self._wait()[test_file]
        problems = {
            case.get("name"): problem.get("message", "")[:1500]
            for case in cases
            for problem in (case.find("failure"), case.find("error"))
            if problem is not None
        }
        details = "\n".join(f"{name}: {message}" for name, message in problems.items())
        assert cases, f"no case of {test_file} ran (exit {self.process.returncode}):\n{self._output()}"
        assert not problems, f"{len(problems)} case(s) failed:\n{details}\n--- output ---\n{self._output()}"
        # A crash after the last case of this module would not show in its cases: say so.
        assert self.process.returncode in (0, 1), f"exit {self.process.returncode}:\n{self._output()}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()
        self._dir.cleanup()


_shared_runs: list[_SharedRun] = []


def start_interpreted_runs(session: pytest.Session) -> None:
    """Start one background subprocess for the declared runs whose test `session` collected."""
    if os.environ.get("TRITON_INTERPRET") == "1" or session.config.option.collectonly:
        return  # this process interprets the kernels itself (those tests skip), or runs nothing
    items = session.items
    wanted = {
        str(Path(item.path).resolve())
        for item in items
        if item.name.endswith("cases_pass_in_an_interpreter_subprocess")
    }
    runs = [run for file, run in _RUNS.items() if file in wanted and run._shared is None]
    if not runs:
        return
    shared = _SharedRun(runs, session.config.rootpath)
    _shared_runs.append(shared)
    for run in runs:
        run._shared = shared


def stop_interpreted_runs() -> None:
    while _shared_runs:
        _shared_runs.pop().stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In the shared subprocess: keep, of a module declared with `-k WORD`, the cases whose name
    holds WORD (as pytest's -k does for these modules: no module or class name holds it)."""
    keywords: dict[str, str] = json.loads(os.environ.get(_KEYWORDS_ENV, "{}"))
    if not keywords:
        return
    kept, dropped = [], []
    for item in items:
        word = keywords.get(str(Path(item.path).resolve()))
        (kept if word is None or word.lower() in item.name.lower() else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
