"""The trust rules: the store reads what lies in it as untrusted input.

The store can hand a root process a binary to run, so it is read like a package index: an
entry is named by what made it (the key) and checked by what it is (the size and sha256 of
every file, recorded when it was published and checked each time it is placed). It reads
nothing another user could have written (as ssh's StrictModes does with ~/.ssh), never
follows a symbolic link inside its tree, keeps every file name inside its entry, and bounds
every wait. Whatever goes wrong with the store, the caller compiles without it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any

from .errors import EntryError, StoreError
from .limits import MAX_DOC

# The longest name an entry's file may have: the file system's own limit for one path
# component (NAME_MAX, 255 bytes on ext4, XFS, btrfs and tmpfs), so every name FlashInfer and
# ninja can write into a build directory is one the store keeps (FlashInfer's batch prefill
# for head dim 128 writes an object named with 212 characters), and none that no build could
# have written.
MAX_NAME_BYTES = 255


def tmp_tag() -> str:
    """What names this writer's temporary files apart from every other's: the process and
    the thread (a warm builds modules on several threads of one process)."""
    return f"{os.getpid()}-{threading.get_ident()}"


def is_file_name(name: object) -> bool:
    """One path component an entry's file may be named by: nothing that leaves the entry."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode("utf-8", "surrogateescape")) <= MAX_NAME_BYTES
        and "/" not in name
        and "\0" not in name
        and not name.startswith(".")
    )


def _mode(st: os.stat_result) -> str:
    return format(stat.S_IMODE(st.st_mode), "04o")


def is_trusted(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0) and not st.st_mode & 0o022


def untrusted_why(path: Path | str, st: os.stat_result) -> str:
    if st.st_uid not in (os.geteuid(), 0):
        return (
            f"{path} belongs to uid {st.st_uid}, not to you (uid {os.geteuid()}) or root: "
            f"the JIT store reads nothing another user could have written (chown -R "
            f"{os.geteuid()} {path}, or point CUDAENV_JIT_STORE at a directory of your own)"
        )
    return (
        f"{path} can be written by other users (mode {_mode(st)}): the JIT store reads nothing "
        f"another user could have written (chmod go-w {path})"
    )


def check_dir(path: Path) -> None:
    """``path`` is a directory of the store: a real directory (not a link) that only the
    invoking user or root owns and can write."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise StoreError(f"{path}: {exc.strerror}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise StoreError(f"{path} is a symbolic link: the JIT store never follows one")
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{path} is not a directory")
    if not is_trusted(st):
        raise StoreError(untrusted_why(path, st))


def check_ancestors(root: Path) -> None:
    """Every directory above the store's root: owned by the user or root, and writable by
    others only with the sticky bit (``/tmp``), so no one else can swap the store."""
    for parent in root.parents:
        st = os.stat(parent)
        if st.st_uid not in (os.geteuid(), 0) or (
            st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        ):
            raise StoreError(untrusted_why(parent, st))


def open_regular(path: Path | str, *, trusted: bool) -> tuple[int, os.stat_result]:
    """``path`` opened for reading without following a link, which must be a regular file
    (a FIFO or a device never blocks us: O_NONBLOCK); when ``trusted``, one that only the user
    or root can write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise EntryError(f"{path} is a symbolic link") from exc
        raise EntryError(f"{path}: {exc.strerror}") from exc
    st = os.fstat(fd)
    why = None
    if not stat.S_ISREG(st.st_mode):
        why = f"{path} is not a regular file"
    elif trusted and not is_trusted(st):
        why = untrusted_why(path, st)
    if why is not None:
        os.close(fd)
        raise EntryError(why)
    return fd, st


def sha256_file(path: Path | str, *, trusted: bool) -> tuple[int, str]:
    """Size and sha256 of the regular file at ``path`` (a link or a FIFO is an EntryError)."""
    fd, _ = open_regular(path, trusted=trusted)
    h, total = hashlib.sha256(), 0
    with os.fdopen(fd, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
            total += len(block)
    return total, h.hexdigest()


def read_doc(path: Path, *, trusted: bool) -> Any:
    fd, st = open_regular(path, trusted=trusted)
    with os.fdopen(fd, "rb") as fh:
        if st.st_size > MAX_DOC:
            raise EntryError(f"{path} is larger than {MAX_DOC >> 20} MiB")
        data = fh.read(MAX_DOC + 1)
    try:
        return json.loads(data)
    except ValueError as exc:
        raise EntryError(f"{path} is not JSON ({exc})") from exc


def stored_identity(st: os.stat_result) -> str | None:
    """What names one version of a stored file for the memo of checked hashes: inode, size,
    mtime and ctime (no process but root can set a ctime back: any write, chmod or utime moves
    it). None for a file changed in the last 2 s, which may change again within one timestamp
    tick (ccache's "too new" rule)."""
    if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < 2 * 10**9:
        return None
    return f"stored:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def copy_checked(
    src: Path | str,
    dst: Path,
    size: int | None,
    sha256: str | None,
    *,
    trusted: bool,
    memo: dict[str, str] | None = None,
) -> tuple[int, str]:
    """Copy ``src`` to ``dst`` (written beside it: a ``.NAME.PID.tmp`` file the caller renames)
    hashing as it goes; raise EntryError when the size or sha256 differs from the record.

    ``memo``: the checked hashes of stored files by :func:`stored_identity`. A file whose
    identity says it is the version already hashed against this record is copied by the kernel
    without being read here (placing costs what copying costs); any other is read once,
    hashed as it is copied, and remembered."""
    fd, st = open_regular(src, trusted=trusted)
    if size is not None and st.st_size != size:
        os.close(fd)
        raise EntryError(f"{src} holds {st.st_size} bytes, its record says {size}")
    ident = stored_identity(st) if memo is not None else None
    known = memo.get(ident) if memo is not None and ident is not None else None
    h, total = hashlib.sha256(), 0
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dst)
    out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        if known is not None and known == sha256:
            # The kernel copies, with no file objects around it: placing a small entry
            # costs what a plain copy does (the bench's "placing with every hash checked").
            while total < st.st_size:
                sent = os.sendfile(out, fd, total, st.st_size - total)
                if sent == 0:
                    break
                total += sent
            digest = known
        else:
            with (
                os.fdopen(fd, "rb", closefd=False) as fh,
                os.fdopen(out, "wb", closefd=False) as sink,
            ):
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
                    sink.write(block)
                    total += len(block)
                    if size is not None and total > size:
                        break
            digest = h.hexdigest()
    except BaseException:
        os.unlink(dst)
        raise
    finally:
        os.close(fd)
        os.close(out)
    if (size is not None and total != size) or (sha256 is not None and digest != sha256):
        os.unlink(dst)
        raise EntryError(f"{src}: content differs from its record (sha256 {digest[:16]}...)")
    if memo is not None and ident is not None and known is None:
        memo[ident] = digest
    return total, digest


def remove_tree(path: Path) -> str | None:
    """Remove the tree at ``path`` (a link is removed, never followed); None when it is
    gone, else why it is not (the OS's words: "Read-only file system")."""
    try:
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return None
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            os.rmdir(path)  # what is left says why it stays
    except FileNotFoundError:
        pass
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total
