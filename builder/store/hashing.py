"""What a key is made of: the content of files (sha256, memoised by inode), of the tools a
compile runs, and text with the env's own path written as ``@ENV@``."""

from __future__ import annotations

import base64
import binascii
import contextlib
import glob
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
# A wheel's RECORD larger than this is not read for them (the CUDA 13 nvcc wheel's: ~40 KB).
MAX_RECORD = 4 * 2**20


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

    def memoised(self, path: str | Path) -> str | None:
        """The memo's sha256 of the regular file at ``path`` (links followed), None where the
        memo has none for it as it is now; nothing is read."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or time.time_ns() - st.st_mtime_ns < 2 * 10**9:
            return None
        return self.memo.get(f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}")

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


# (device, inode) -> (size, sha256 in hex) of a file, as the RECORD of its wheel states it.
Recorded = Mapping[tuple[int, int], tuple[int, str]]


def recorded_tools(site: str) -> dict[tuple[int, int], tuple[int, str]]:
    """The toolkit's binaries (:data:`TOOLKIT_TOOLS`) as the RECORDs of the NVIDIA wheels
    below ``site`` state them, by the inode each RECORD row's file has: what a key may take
    for their content instead of reading ~190 MB (0.15 s on a node whose memo is empty).

    What vouches for it: the lock's sha256 for the wheel, the wheel for its RECORD, and the
    build's install proof for each file's presence and size (installproof.py). A file of the
    recorded size whose bytes differ (changed in uv's cache after uv unpacked it) makes the key
    name the toolkit the lock promised, not the one on disk: a lookup then takes what that
    toolkit built, and whatever publishes under such a key hashes the real bytes first and
    keeps nothing when they differ (sourcebuild.py), so no entry is made by a toolkit its key
    does not name. Rows are read only where they name a regular file inside ``site``."""
    wanted = {os.path.basename(t) for t in TOOLKIT_TOOLS}
    found: dict[tuple[int, int], tuple[int, str]] = {}
    for record in glob.glob(os.path.join(glob.escape(site), "nvidia_*.dist-info", "RECORD")):
        try:
            with open(record, encoding="utf-8", errors="replace") as fh:
                text = fh.read(MAX_RECORD + 1)
        except OSError:
            continue
        if len(text) > MAX_RECORD:
            continue
        for line in text.splitlines():
            # A toolkit binary's path has no comma, so no csv quoting (PEP 376): a quoted
            # row is never one of them.
            rel, _, rest = line.partition(",")
            if os.path.basename(rel) not in wanted or line.startswith('"'):
                continue
            digest, _, size = rest.partition(",")
            algorithm, _, b64 = digest.partition("=")
            path = os.path.normpath(os.path.join(site, rel))
            if algorithm != "sha256" or not path.startswith(site.rstrip("/") + "/"):
                continue
            try:
                raw = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
                st = os.lstat(path)
                recorded_size = int(size)
            except (OSError, ValueError, binascii.Error):
                continue
            if len(raw) == 32 and stat.S_ISREG(st.st_mode):
                found[(st.st_dev, st.st_ino)] = (recorded_size, raw.hex())
    return found


class RecordedTools(Mapping[tuple[int, int], tuple[int, str]]):
    """:func:`recorded_tools` of ``site``, read at the first question: a key whose toolkit
    files are all in the hasher's memo (every build after a node's first) reads no RECORD."""

    def __init__(self, site: str | None) -> None:
        self._site = site
        self._found: dict[tuple[int, int], tuple[int, str]] | None = None

    @classmethod
    def in_env(cls, prefix: str | Path) -> RecordedTools:
        """Those of the env at ``prefix`` (its site-packages; none for a tree without one)."""
        sites = sorted(glob.glob(os.path.join(glob.escape(str(prefix)), "lib", "python3*",
                                              "site-packages")))  # fmt: skip
        return cls(sites[0] if sites else None)

    def _rows(self) -> dict[tuple[int, int], tuple[int, str]]:
        if self._found is None:
            self._found = recorded_tools(self._site) if self._site else {}
        return self._found

    def __getitem__(self, item: tuple[int, int]) -> tuple[int, str]:
        return self._rows()[item]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())


def _as_recorded(path: str, recorded: Recorded) -> str | None:
    """``path``'s content as ``recorded`` states it: None unless it is one of those inodes, a
    regular file at the recorded size."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    known = recorded.get((st.st_dev, st.st_ino))
    if known is None or not stat.S_ISREG(st.st_mode) or st.st_size != known[0]:
        return None
    return known[1]


def tool_identities(
    hasher: Hasher,
    cuda_home: str,
    compilers: Sequence[str],
    env: Mapping[str, str],
    recorded: Recorded | None = None,
) -> dict[str, str | None]:
    """Content of the toolkit's binaries and of each host compiler (found on the env's PATH
    as nvcc and ninja find them), and the NVCC_* variables. ``recorded``
    (:func:`recorded_tools`): toolkit files taken as their wheels' RECORDs state them; the
    others are hashed."""
    out: dict[str, str | None] = {}
    for rel in TOOLKIT_TOOLS:
        path = os.path.join(cuda_home, rel)
        out[rel] = (
            hasher.memoised(path)
            or (_as_recorded(path, recorded) if recorded is not None else None)
            or hasher.sha256(path)
        )
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
