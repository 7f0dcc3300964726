"""Where tokenmill keeps what it fetches or builds once per machine (models, tokenizers, kernels).

Low in the package order so that kernels, model loaders and tokenizers can all share it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TOKENMILL_CACHE, default ~/.cache/tokenmill."""
    return Path(os.environ.get("TOKENMILL_CACHE") or Path.home() / ".cache" / "tokenmill")
