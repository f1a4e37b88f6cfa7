"""The toolkits of this machine: the nvcc release of a toolkit (``release 13.0``), read once
per nvcc file: the answer is memoised by the file's identity in cudaenv's cache, so a warm
build runs no nvcc.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

from builder.core import cachefiles, proc
from builder.core.errors import BuildError, ToolMissing
from builder.core.paths import cache_dir

if TYPE_CHECKING:
    pass


def file_identity(path: Path) -> list[int] | None:
    """(device, inode, size, mtime) of the file ``path`` resolves to: the same numbers mean
    the same bytes unless the file was rewritten in place with its mtime forged. None when
    it cannot be read."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _nvcc_memo() -> Path:
    return cache_dir() / "nvcc-releases.json"


# Entries kept in the memo: with uv's hard links every env's nvcc is the one file of uv's cache
# (one entry per toolkit); with UV_LINK_MODE=copy each build adds a file nobody asks again.
_NVCC_MEMO_ENTRIES = 32


def _nvcc_release(nvcc: Path) -> str:
    """``release 13.0`` out of ``nvcc --version``, memoised by the identity of the nvcc file.

    A wheel-built env's ``cuda-home/bin/nvcc`` is a hard link to uv's cached copy, so every
    build of a toolkit asks the same file; running it costs ~10 ms of a ~3 s warm build."""
    identity = file_identity(nvcc)
    key = ":".join(map(str, identity)) if identity else None
    memo: dict[str, str] = {}
    if key is not None:
        doc = cachefiles.read_json(_nvcc_memo())
        if isinstance(doc, dict):
            memo = {str(k): str(v) for k, v in doc.items()}
        if key in memo:
            return memo[key]
    release = _run_nvcc_version(nvcc)
    if key is not None:
        memo.pop(key, None)
        memo[key] = release
        kept = dict(list(memo.items())[-_NVCC_MEMO_ENTRIES:])
        cachefiles.write_text(_nvcc_memo(), json.dumps(kept, indent=1))
    return release


def _run_nvcc_version(nvcc: Path) -> str:
    try:
        done = proc.run([nvcc, "--version"], timeout=60)
    except proc.CommandFailed as exc:
        raise BuildError(f"{nvcc} --version failed:\n{exc.output.strip()}") from exc
    m = re.search(r"release (\d+\.\d+),", done.stdout)
    if not m:
        raise BuildError(f"{nvcc} --version printed no 'release X.Y': {done.stdout.strip()!r}")
    return m.group(1)


def nvcc_release(cuda_home: Path) -> str:
    nvcc = cuda_home / "bin" / "nvcc"
    if not nvcc.exists():
        raise ToolMissing(f"{nvcc}: no nvcc in this toolkit", tool=str(nvcc))
    return _nvcc_release(nvcc)
