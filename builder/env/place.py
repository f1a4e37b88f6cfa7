"""Putting a finished env in place: one process at a time per env (``env_lock``, a ``flock``
the kernel drops when its holder dies), the exchange of the finished tree with the old one in
one ``renameat2(RENAME_EXCHANGE)`` (``swap_into_place``), what killed builds left
(``clean_leftovers``), and what a build that ran out of room says (``no_space``)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from builder.core import proc
from builder.core.errors import BuildError, EnvBusy
from builder.store.locking import flock_within

Progress = Callable[[str], None]


# --------------------------------------------------------------------------- atomic swap


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE). False if unsupported."""
    # The symbols already loaded into this process (libc among them), not
    # ctypes.util.find_library("c"): that runs `ldconfig -p` in a subprocess (~5 ms).
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def swap_into_place(new: Path, target: Path) -> Path | None:
    """Put ``new`` at ``target``; return where the previous env now is (to delete), if any."""
    if not target.exists() and not target.is_symlink():
        os.rename(new, target)
        return None
    if _exchange(new, target):
        return new  # new now holds the old tree
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    os.rename(target, old)
    os.rename(new, target)
    return old


def clean_leftovers(target: Path) -> list[Path]:
    """Remove what killed builds of this env left (call with the env lock held)."""
    removed = []
    for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
        for path in target.parent.glob(pattern):
            proc.delete(path)
            removed.append(path)
    return removed


@contextlib.contextmanager
def env_lock(
    target: Path,
    progress: Progress,
    *,
    flock_path: Path | None = None,
    holder: str = "cudaenv build",
    doing: str = "building",
    wait: float | None = None,
) -> Iterator[None]:
    """One process at a time changes ``target``. ``flock_path`` (default ``.NAME.lock`` beside
    the env: a build replaces the env's directory whole) holds the holder's name for a waiter
    to print. ``wait``: seconds to wait before EnvBusy names the holder; None waits as long as
    it takes (a build queued behind another build of the same spec)."""
    if flock_path is None:
        target.parent.mkdir(parents=True, exist_ok=True)
        flock_path = target.parent / f".{target.name}.lock"
    while True:
        fh = flock_path.open("a+")
        try:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                who = fh.read().strip() or "another process"
                progress(f"waiting for {who} to finish {doing} {target} (lock {flock_path})")
                if wait is None:
                    fcntl.flock(fh, fcntl.LOCK_EX)
                elif not flock_within(fh.fileno(), wait):
                    raise EnvBusy(
                        f"{target}: {who} holds its lock {flock_path} after a wait of {wait:g} s; "
                        "nothing was changed: run again when it has finished"
                    ) from None
            # `cudaenv remove` deletes the lock file while holding it (envs.py): a waiter that
            # got the deleted file's lock takes the one now at the path, or two builds would run.
            try:
                current = flock_path.stat().st_ino == os.fstat(fh.fileno()).st_ino
            except FileNotFoundError:
                current = False
        except BaseException:
            fh.close()
            raise
        if current:
            break
        fh.close()
    with fh:
        fh.seek(0)
        fh.truncate()
        fh.write(f"{holder} pid {os.getpid()}")
        fh.flush()
        try:
            yield
        finally:
            fh.seek(0)
            fh.truncate()
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def build_lock(target: Path, progress: Progress) -> Iterator[None]:
    """:func:`env_lock` for a build: a lock that cannot be made (a read-only or missing
    ``--env-dir`` parent) is one BuildError naming the file, not a traceback."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(env_lock(target, progress))
        except OSError as exc:
            where = Path(exc.filename) if exc.filename else target.parent
            raise BuildError(
                f"{where}: cannot take the lock of {target} ({exc.strerror}); the env's "
                "directory must be writable by this user: pass --env-dir on a writable "
                "filesystem. Nothing was changed"
            ) from exc
        yield


# A full filesystem (ENOSPC) or a full quota (EDQUOT): as OSError errnos, and as uv (Rust's
# io::Error) words them in its output, "No space left on device (os error 28)".
NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE = re.compile(
    rf"No space left on device|Disk quota exceeded|\(os error (?:{errno.ENOSPC}|{errno.EDQUOT})\)"
)


def out_of_space(output: str) -> bool:
    """Whether a command's output says it met a full filesystem or quota."""
    return _NO_SPACE.search(output) is not None


def over_quota(output: str) -> bool:
    return "Disk quota exceeded" in output or f"(os error {errno.EDQUOT})" in output


def tree_bytes(root: Path) -> int:
    """The bytes of the files below ``root``, each inode once (cuda-home/bin/ hard-links the
    toolkit's binaries)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                st = (Path(top) / name).lstat()
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def no_space(tmp: Path, target: Path, *, quota: bool = False, said: str = "") -> str:
    """What a build that ran out of room says: where, how much room it had, how much the env
    there now holds (what a build of the same lock needs, as a copy: uv copies instead of
    hard-linking when its cache is on another filesystem), and the line of ``said`` (a
    command's output) that names the file it could not write (uv's cache may be the full
    one)."""
    # What the build had: what is free now plus what it wrote (removed as the error unwinds).
    room = (shutil.disk_usage(tmp.parent).free + tree_bytes(tmp)) // 2**20
    quota = quota or over_quota(said)
    what = "the disk quota was exceeded" if quota else "no space left on device"
    needs = ""
    if target.is_dir() and not target.is_symlink():
        needs = f"; the env there now holds {tree_bytes(target) // 2**20} MiB of files"
    lines = [ln.strip() for ln in said.splitlines() if out_of_space(ln)]
    if lines:
        needs += f"; uv: {lines[-1][:400]}"
    return (
        f"{what} while building in {tmp.parent} (the build had {room} MiB{needs}); free space "
        "there or "
        "pass --env-dir on a larger filesystem. Nothing was replaced: the previous env, if "
        "any, is intact"
    )
