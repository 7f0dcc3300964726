"""Running a test module's Triton cases under the CPU interpreter in a subprocess.

TRITON_INTERPRET is read when triton is first imported, so a pytest process that imported it
compiled (any GPU-capable run, or an earlier module) cannot interpret kernels itself: such modules
have one test that reruns the module with TRITON_INTERPRET=1 in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys


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
