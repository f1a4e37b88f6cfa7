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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import StoreError
from .trust import is_trusted, untrusted_why

# How often a waiter hears who it waits for.
TELL_EVERY = 15.0


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its holder wrote it: its pid, when it took the lock (epoch
    seconds; 0 when unknown) and what it builds."""

    pid: str
    since: float = 0.0
    what: str = ""

    @classmethod
    def read(cls, fd: int) -> Holder:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
        pid, _, rest = text.partition(" ")
        since, _, what = rest.partition(" ")
        try:
            started = float(since)
        except ValueError:
            started = 0.0
        return cls(pid if pid.isdigit() else "?", started, what.strip()[:200])


# Told (the holder, the seconds waited so far) while a lock is waited for.
Waiting = Callable[[Holder, float], None]


def flock_within(fd: int, wait: float, on_wait: Callable[[float], None] | None = None) -> bool:
    """An exclusive ``flock`` on ``fd`` taken within ``wait`` seconds; False when another
    process still holds it at the deadline (a wait of 0 tries once). ``on_wait`` is called
    with the seconds waited every :data:`TELL_EVERY` seconds."""
    started = time.monotonic()
    deadline = started + wait
    told = started
    delay = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            now = time.monotonic()
            if now >= deadline:
                return False
            if on_wait is not None and now - told >= TELL_EVERY:
                told = now
                on_wait(now - started)
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


def lock_file(path: Path, wait: float, *, note: str = "", waiting: Waiting | None = None) -> Lock:
    """The lock file at ``path`` (made if missing; never a link, and one only the user or root
    can write) held within ``wait`` seconds, with this process's pid, the time and ``note``
    written in it for a waiter to name (``waiting`` hears of the holder while this waits).
    StoreError otherwise, naming the process that holds it."""
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

    def told(waited: float) -> None:
        if waiting is not None:
            waiting(Holder.read(fd), waited)

    if not flock_within(fd, wait, told if waiting is not None else None):
        holder = Holder.read(fd)
        os.close(fd)
        raise StoreError(
            f"waited {wait:.0f} s for the JIT store's lock {path} (held by pid "
            f"{holder.pid}); compiled without the store"
        )
    line = " ".join(f"{os.getpid()} {time.time():.0f} {note}".split())
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{line}\n".encode(), 0)
    return Lock(fd)
