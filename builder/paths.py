"""Where cudaenv keeps things on disk: built envs, and its machine-wide cache.

One place, so the cache of interpreters, resolutions, channel pins and tools moves together
with ``XDG_CACHE_HOME`` (or ``CUDAENV_CACHE_DIR``), and tests can point all of it elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path

# Built envs, relative to the directory cudaenv runs in (git-ignored in this repository).
ENVS_DIR = Path(".envs")
# Matrix cells: .envs/.matrix/MATRIX/ holds each matrix's generated specs, locks and envs.
MATRIX_DIR = ENVS_DIR / ".matrix"


def cache_dir() -> Path:
    """``$CUDAENV_CACHE_DIR``, else ``$XDG_CACHE_HOME/cudaenv``, else ``~/.cache/cudaenv``."""
    own = os.environ.get("CUDAENV_CACHE_DIR")
    if own:
        return Path(own)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cudaenv"


def jit_store_dir() -> Path | None:
    """The machine-wide store of compiled JIT results (probe/jit_store.py): ``$CUDAENV_JIT_STORE``
    (``off`` turns it off), else ``jit-store`` in the cache directory."""
    own = os.environ.get("CUDAENV_JIT_STORE")
    if own == "off":
        return None
    return Path(own) if own else cache_dir() / "jit-store"
