"""Where tokenmill keeps what it fetches or builds once per machine (models, tokenizers, kernels).

Low in the package order so that kernels, model loaders and tokenizers can all share it.
"""

from __future__ import annotations

from pathlib import Path

from tokenmill import envs


def cache_dir() -> Path:
    """$TOKENMILL_CACHE, default ~/.cache/tokenmill."""
    return Path(envs.TOKENMILL_CACHE.get() or Path.home() / ".cache" / "tokenmill")
