"""Locks with a deadline: ``flock`` has no timeout of its own, so a waiter polls (10 ms
growing to 250 ms) until the lock is free or its time is up. The store's per-key lock and
cudaenv's per-env build lock both wait this way; the kernel drops a lock when its holder dies,
so a killed process never leaves a stale one."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from pathlib import Path

from .errors import StoreError
from .trust import is_trusted, untrusted_why


def flock_within(fd: int, wait: float) -> bool:
    """An exclusive ``flock`` on ``fd`` taken within ``wait`` seconds; False when another
    process still holds it at the deadline (a wait of 0 tries once)."""
    deadline = time.monotonic() + wait
    delay = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.25)


class Lock:
    """A key's lock, held: released with :meth:`release`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def lock_file(path: Path, wait: float) -> Lock:
    """The lock file at ``path`` (made if missing; never a link, and one only the user or root
    can write) held within ``wait`` seconds, with this process's pid written in it for a
    waiter to name. StoreError otherwise, naming the process that holds it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise StoreError(f"{path} {why}: the store was not used") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or not is_trusted(st):
        os.close(fd)
        raise StoreError(
            untrusted_why(path, st) if stat.S_ISREG(st.st_mode) else f"{path} is not a file"
        )
    if not flock_within(fd, wait):
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StoreError(
            f"waited {wait:.0f} s for the JIT store's lock {path} (held by pid "
            f"{holder}); compiled without the store"
        )
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return Lock(fd)
