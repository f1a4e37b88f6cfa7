"""The files cudaenv reads back or runs from its cache directory, held to the JIT store's rules.

cudaenv often runs as root, and what it keeps in its cache (memos of parses and renders, the
interpreters it found, uv's last resolution, scan results, the tools it installed) decides
what a build writes into an env and what a check runs. A cache another user can write is a
way for them to run code as root. So a cache file is used only where nobody but this user or
root could have written it, as ssh's StrictModes judges a ``authorized_keys``:

- every directory from the cache root down to the file, and the file itself, is owned by this
  user or root and writable by no one else; the directories above the cache root are owned by
  this user or root and writable by others only with the sticky bit (``/tmp``);
- no symbolic link is followed, in the directories or at the file (``O_NOFOLLOW``);
- a write goes to a new temporary file (``O_CREAT | O_EXCL | O_NOFOLLOW``) renamed over the
  name, so a link planted there is replaced, never written through.

Anything else is not used: one warning naming the path and the ``chmod``/``chown`` that fixes
it, then the run goes on without the cache (a memo is recomputed, a tool installed afresh).
A tool is run from the cache only where the sha256 recorded when it was installed still
matches (:func:`vouched`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import os
import secrets
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from builder.core import settings
from builder.core.errors import printable_block

# A memo, a list of interpreters, uv's output: far below this. A file above it is not a cache
# file cudaenv wrote, and reading it would only cost memory.
MAX_BYTES = 64 * 1024 * 1024

_warned: set[str] = set()


class Refused(Exception):
    """Why a cache path is not used: one line naming the path and the fix."""


def warn(why: str) -> None:
    """``why`` once per process on stderr: a cache that is refused costs time, not the run."""
    if why in _warned:
        return
    _warned.add(why)
    print(
        f"cudaenv: warning: {printable_block(why)}; going on without it",
        file=sys.stderr,
        flush=True,
    )


def _trusted(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0) and not st.st_mode & 0o022


def _untrusted(path: Path, st: os.stat_result) -> Refused:
    if st.st_uid not in (os.geteuid(), 0):
        return Refused(
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}) or root: "
            f"cudaenv uses nothing in its cache that another user could have written "
            f"(chown -R {os.geteuid()} {path}, or point CUDAENV_CACHE_DIR at a directory of "
            "your own)"
        )
    return Refused(
        f"{path} can be written by other users (mode {stat.S_IMODE(st.st_mode):04o}): cudaenv "
        f"uses nothing in its cache that another user could have written (chmod go-w {path})"
    )


def configured() -> Path:
    """``$CUDAENV_CACHE_DIR``, else ``$XDG_CACHE_HOME/cudaenv``, else ``~/.cache/cudaenv``."""
    return settings.current().cache_dir


# A refused cache root -> this process's own temporary cache, made once and removed at exit.
_instead: dict[Path, Path] = {}


def cache_dir() -> Path:
    """The cache directory: :func:`configured` where it and the directories above it pass the
    rules (or it is not made yet: the first write makes it under them); else, with one
    warning, a private temporary one for this process, so that nothing another user put there
    (a memo, a tool, a verify work directory, the JIT store) is read, run or written into."""
    chosen = configured()
    if chosen in _instead:
        return _instead[chosen]
    try:
        _check_ancestors(chosen)
        if chosen.is_symlink():
            # A link of the user's own (~/.cache/cudaenv -> /data/cache): whoever could swap
            # it is judged above; the directory it names is the cache, judged as one.
            chosen = chosen.resolve()
            _check_ancestors(chosen)
        _check_dir(chosen, make=False)
    except FileNotFoundError:
        return chosen
    except Refused as exc:
        warn(str(exc))
        own = Path(tempfile.mkdtemp(prefix="cudaenv-cache-"))
        atexit.register(shutil.rmtree, own, True)
        _instead[configured()] = own
        return own
    return chosen


def _root_of(path: Path) -> Path:
    """The directory whose subtree ``path`` is judged in: the cache root when ``path`` lies
    below it, else ``path``'s own directory (a cache file a caller placed elsewhere)."""
    root = cache_dir()
    try:
        path.relative_to(root)
    except ValueError:
        return path.parent
    return root


def _check_ancestors(root: Path) -> None:
    """The directories above the cache root: nobody else can rename the cache away and put
    their own in its place (a shared ``/tmp`` is fine: its sticky bit prevents that)."""
    for parent in root.parents:
        try:
            st = parent.stat()
        except FileNotFoundError:
            continue  # made by the first write, by this user
        if st.st_uid not in (os.geteuid(), 0) or (
            st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        ):
            raise _untrusted(parent, st)


def _check_dir(path: Path, *, make: bool) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if not make:
            raise
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o755)
        st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise Refused(f"{path} is a symbolic link: cudaenv follows none in its cache (rm {path})")
    if not stat.S_ISDIR(st.st_mode):
        raise Refused(f"{path} is not a directory (rm {path})")
    if not _trusted(st):
        raise _untrusted(path, st)


def check_dirs(directory: Path, *, make: bool = False) -> None:
    """``directory`` and every directory from the cache root down to it pass the rules (made
    when missing, with ``make``). Raises :class:`Refused`, or FileNotFoundError for a missing
    one without ``make``."""
    root = _root_of(directory / "_")
    if make:
        root.parent.mkdir(parents=True, exist_ok=True)
    _check_ancestors(root)
    _check_dir(root, make=make)
    for part in directory.relative_to(root).parts:
        root = root / part
        _check_dir(root, make=make)


def _open(path: Path) -> tuple[int, os.stat_result]:
    """``path`` opened for reading under the rules. FileNotFoundError where it is absent."""
    check_dirs(path.parent)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused(
                f"{path} is a symbolic link: cudaenv follows none in its cache (rm {path})"
            ) from None
        raise
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = Refused(f"{path} is not a regular file (rm {path})")
    elif not _trusted(st):
        problem = _untrusted(path, st)
    if problem is not None:
        os.close(fd)
        raise problem
    return fd, st


def _opened(path: Path) -> tuple[int, os.stat_result] | None:
    """:func:`_open`, or None where ``path`` is absent, unreadable or refused (one warning)."""
    try:
        return _open(path)
    except Refused as exc:
        warn(str(exc))
    except OSError:
        pass
    return None


def usable(path: Path) -> bool:
    """Whether ``path`` is a regular file that passes the rules, its directories too (absent:
    False; refused: False, with one warning). For a file that is used where it lies (a built
    kernel run by a check) rather than read."""
    opened = _opened(path)
    if opened is None:
        return False
    os.close(opened[0])
    return True


def read_bytes(path: Path, limit: int = MAX_BYTES) -> bytes | None:
    """What the cache file ``path`` holds; None where it is absent, unreadable, larger than
    ``limit``, or refused (then with one warning)."""
    opened = _opened(path)
    if opened is None:
        return None
    fd, st = opened
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > limit:
            return None
        data = fh.read(limit + 1)
    return data if len(data) <= limit else None


def read_text(path: Path) -> str | None:
    data = read_bytes(path)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_json(path: Path) -> Any:
    """The JSON document in ``path``; None where :func:`read_bytes` gives none or it is not
    JSON (a memo is only a memo: the caller computes it afresh)."""
    data = read_bytes(path)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def write_bytes(path: Path, data: bytes, mode: int = 0o644) -> bool:
    """``data`` as the cache file ``path``, whole or not at all: a temporary file created
    without following a link, synced, then renamed over ``path``. False where the cache is
    refused (one warning) or cannot be written (a cache that cannot be kept costs time)."""
    try:
        check_dirs(path.parent, make=True)
    except Refused as exc:
        warn(str(exc))
        return False
    except OSError:
        return False
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        return False
    return True


def write_text(path: Path, text: str) -> bool:
    return write_bytes(path, text.encode("utf-8"))


def write_json(path: Path, doc: object) -> bool:
    return write_bytes(path, json.dumps(doc, sort_keys=True).encode())


def own_dir(directory: Path) -> Path | None:
    """``directory`` in the cache, made where missing, once it and every directory above it
    up to the cache root pass the rules; None where refused (one warning) or not makable."""
    try:
        check_dirs(directory, make=True)
    except Refused as exc:
        warn(str(exc))
        return None
    except OSError:
        return None
    return directory


def sha256(path: Path) -> str | None:
    """The sha256 of the cache file ``path`` read under the rules; None where it is absent
    or refused (one warning)."""
    opened = _opened(path)
    if opened is None:
        return None
    digest = hashlib.sha256()
    with os.fdopen(opened[0], "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def vouched(exe: Path, record: Path) -> bool:
    """Whether the cached executable ``exe`` may run: the directories and the file pass the
    rules and its sha256 is the one ``record`` (a JSON file this user wrote when it installed
    the tool: ``{"sha256": ...}``) holds. Anything else runs nothing from the cache."""
    doc = read_json(record)
    expected = doc.get("sha256") if isinstance(doc, dict) else None
    if not isinstance(expected, str):
        return False
    found = sha256(exe)
    if found is not None and found != expected:
        warn(
            f"{exe} is not the file cudaenv installed (sha256 {found[:12]}..., recorded "
            f"{expected[:12]}... in {record}): it is not run, and is installed again"
        )
    return found == expected


def record_tool(exe: Path, record: Path) -> bool:
    """Record the sha256 of ``exe``, just installed by this process, in ``record``."""
    digest = sha256(exe)
    return digest is not None and write_json(record, {"sha256": digest, "path": str(exe)})
