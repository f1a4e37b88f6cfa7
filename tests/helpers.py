"""Plain helpers shared by the test modules: import them from here, never from conftest.py
(pytest's to load, not ours) or from another test module."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from builder import spec

REPO = Path(__file__).resolve().parent.parent
ENVSPECS = REPO / "envspecs"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def cudaenv(
    *args: str, cwd: Path, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process, on this checkout's sources."""
    done = subprocess.run(
        [sys.executable, "-m", "builder.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"cudaenv {' '.join(args)} -> {done.returncode}\n{done.stderr}")
    return done


def workspace(tmp: Path, *names: str) -> Path:
    """A copy of the named specs with their committed locks, so builds land under tmp."""
    (tmp / "envspecs" / "locks").mkdir(parents=True)
    for name in names:
        s = spec.load(ENVSPECS / name)
        shutil.copy(ENVSPECS / name, tmp / "envspecs" / name)
        lock_name = f"pylock.{s.name}.toml"
        shutil.copy(ENVSPECS / "locks" / lock_name, tmp / "envspecs" / "locks" / lock_name)
    return tmp
