"""What a key is made of: the content of files (sha256, memoised by inode), of the tools a
compile runs, and text with the env's own path written as ``@ENV@``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .entries import VERSION
from .errors import StoreError
from .trust import check_dir, read_doc, tmp_tag

ENV = "@ENV@"
# What nvcc reads from the environment on top of its command line. Written out: this module
# runs inside the env's interpreter and imports nothing of cudaenv; a test keeps it equal to
# builder/core/variables.py's NVCC.
NVCC_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")
# The binaries nvcc runs (bin/ and nvvm/bin/ of CUDA_HOME): their content is in the key.
TOOLKIT_TOOLS = ("bin/nvcc", "bin/ptxas", "bin/fatbinary", "bin/nvlink", "bin/cudafe++",
                 "bin/bin2c", "nvvm/bin/cicc")  # fmt: skip


class Hasher:
    """sha256 of files, memoised by (device, inode, size, mtime): an env's toolkit files are
    hard links into uv's cache, so every env of one toolkit asks about the same inodes."""

    def __init__(self, memo: Path | None) -> None:
        self.memo_path = memo
        self.memo: dict[str, str] = {}
        self.dirty = False
        if memo is not None:
            # A memo another user could write would make a changed header look unchanged:
            # read only from a directory and a file no one else can write.
            with contextlib.suppress(OSError, ValueError, StoreError):
                check_dir(memo.parent)
                loaded = read_doc(memo, trusted=True)
                if isinstance(loaded, dict):
                    self.memo = {str(k): str(v) for k, v in loaded.items()}

    def sha256(self, path: str | Path, limit: int | None = None) -> str | None:
        """The content of the regular file at ``path`` (links followed: a toolkit's headers
        are links into the wheel prefix); None for anything else, or one over ``limit``."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or (limit is not None and st.st_size > limit):
            return None
        ident = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        # A file changed in the last seconds may change again within one timestamp tick
        # without its identity changing (ccache's "too new" rule): hashed, never memoised.
        recent = time.time_ns() - st.st_mtime_ns < 2 * 10**9
        found = None if recent else self.memo.get(ident)
        if found is not None:
            return found
        h = hashlib.sha256()
        try:
            # O_NONBLOCK: a path swapped for a FIFO since the stat never blocks the build.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        except OSError:
            return None
        if recent:
            return h.hexdigest()
        self.memo[ident] = h.hexdigest()
        self.dirty = True
        return self.memo[ident]

    def save(self) -> None:
        if self.memo_path is None or not self.dirty:
            return
        with contextlib.suppress(OSError, StoreError):
            self.memo_path.parent.mkdir(parents=True, exist_ok=True)
            check_dir(self.memo_path.parent)
            kept = dict(list(self.memo.items())[-20000:])
            tmp = self.memo_path.with_name(f".{self.memo_path.name}.{tmp_tag()}")
            tmp.write_text(json.dumps(kept))
            tmp.chmod(0o644)  # whatever the umask: a memo others can write is never read
            tmp.replace(self.memo_path)


def which(name: str, path: str | None) -> str | None:
    return shutil.which(name, path=path)


def tool_identities(
    hasher: Hasher, cuda_home: str, compilers: Sequence[str], env: Mapping[str, str]
) -> dict[str, str | None]:
    """Content of the toolkit's binaries and of each host compiler (found on the env's PATH
    as nvcc and ninja find them), and the NVCC_* variables."""
    out: dict[str, str | None] = {}
    for rel in TOOLKIT_TOOLS:
        out[rel] = hasher.sha256(os.path.join(cuda_home, rel))
    for name in compilers:
        found = which(name, env.get("PATH"))
        out[f"host:{name}"] = hasher.sha256(os.path.realpath(found)) if found else None
    for key in NVCC_ENV:
        out[f"env:{key}"] = env.get(key, "")
    return out


def normalise(text: str, roots: Iterable[str], placeholder: str = ENV) -> str:
    """``text`` with each spelling of the env's root replaced by ``placeholder``."""
    for root in sorted({r.rstrip("/") for r in roots if r and r != "/"}, key=len, reverse=True):
        text = text.replace(root, placeholder)
    return text


def localise(text: str, root: str) -> str:
    return text.replace(ENV, root.rstrip("/"))


def env_roots(prefix: str) -> list[str]:
    """How the env's path can be spelt in what its tools write (as given and resolved)."""
    return [prefix, os.path.realpath(prefix)]


def key_of(material: Mapping[str, Any]) -> str:
    blob = json.dumps({"store": VERSION, **material}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()
