"""Ending a child with everything it started: the one way a child cudaenv started is stopped
(a timeout, Ctrl-C, SIGTERM, a body that raised), so that no compiler, ninja or uv it left
writes on into a directory the next command uses.

Every child leads a session of its own (proc._start), so a terminal's Ctrl-C reaches cudaenv
alone and cudaenv ends each child here: its whole tree as /proc shows it when the end begins
(a grandchild that left the group with ``setsid`` included, while its parent lives) and every
process of its group, each pinned by a pidfd (a pid reused meanwhile is never signalled), sent
SIGTERM (ninja deletes the outputs of the commands it stops; uv removes its temporary
directories), then SIGKILL after ``GRACE`` seconds, and waited for until each has exited, at
most ``GONE`` seconds. A descendant that left the session *and* whose parent ended before the
end began is out of reach without a cgroup: docs/concepts/store-trust.md says so.

At an interrupt the CLI ends every child still running (:func:`end_all`): one started from a
worker thread (a lock's platforms, a matrix cell) is waited for by that thread, which would
otherwise wait for a compile no signal reached.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
import weakref
from pathlib import Path
from typing import Any

# Seconds a tree is given to end after SIGTERM (ninja's clean-up of a stopped compile takes
# milliseconds), and at most after SIGKILL for every process of it to be gone.
GRACE = 2.0
GONE = 10.0

_LIVE: weakref.WeakSet[subprocess.Popen[Any]] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def track(child: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
    """``child``, remembered until it is collected, for :func:`end_all`."""
    with _LIVE_LOCK:
        _LIVE.add(child)
    return child


def end_all() -> int:
    """End every tracked child still running; how many there were."""
    with _LIVE_LOCK:
        running = [child for child in _LIVE if child.returncode is None]
    ended = 0
    for child in running:
        if child.poll() is None:
            end(child)
            ended += 1
    return ended


def tree(root: int, *, reaped: bool = False) -> list[int]:
    """The processes of ``root``'s tree, as /proc shows them now: every process of its session
    and of its group (``root`` leads both: proc._start; ninja puts each command in a group of
    its own, in that session), ``root`` itself and every process below any of them (a
    grandchild that left with ``setsid``, while its parent lives). ``reaped``: ``root`` was
    waited for already, so its pid may be another process's now: only the session and group,
    which keep its number from being reused while any member lives, and what is below them.
    [root] (or [] when reaped) where /proc cannot be read."""
    below: dict[int, list[int]] = {}
    found: set[int] = set() if reaped else {root}
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return sorted(found)
    for name in entries:
        try:
            raw = Path(f"/proc/{name}/stat").read_bytes()
            # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses.
            fields = raw[raw.rindex(b")") + 2 :].split()
            ppid, pgrp, session = int(fields[1]), int(fields[2]), int(fields[3])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not a process's stat
        pid = int(name)
        below.setdefault(ppid, []).append(pid)
        if pid != root and root in (pgrp, session):
            found.add(pid)
    todo = list(found)
    while todo:
        for pid in below.get(todo.pop(), []):
            if pid not in found:
                found.add(pid)
                todo.append(pid)
    return sorted(found)


class _Pinned:
    """The processes of a tree, each by a pidfd where the kernel has them (Linux 5.3): a
    signal reaches the process seen, never a later one given its pid."""

    def __init__(self, pids: list[int]) -> None:
        self.fds: dict[int, int | None] = {}
        self.add(pids)

    def add(self, pids: list[int]) -> None:
        for pid in pids:
            if pid in self.fds:
                continue
            try:
                self.fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # gone already
            except (OSError, AttributeError):
                self.fds[pid] = None

    def signal(self, signum: int) -> None:
        for pid, fd in self.fds.items():
            with contextlib.suppress(OSError):
                if fd is not None:
                    signal.pidfd_send_signal(fd, signum)
                else:
                    os.kill(pid, signum)

    def wait(self, until: float) -> bool:
        """Wait until every process has exited (a zombie has), or ``until``; whether all did."""
        while True:
            left = [pid for pid in self.fds if self._alive(pid)]
            if not left:
                return True
            now = time.monotonic()
            if now >= until:
                return False
            fds = [fd for pid in left if (fd := self.fds[pid]) is not None]
            if len(fds) == len(left):
                # poll, not select: a pidfd may be numbered past select's 1024.
                poller = select.poll()
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                poller.poll(max(int((until - now) * 1000), 1))
            else:
                time.sleep(min(0.05, until - now))

    def _alive(self, pid: int) -> bool:
        fd = self.fds[pid]
        if fd is not None:  # readable once the process has exited
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return not poller.poll(0)
        try:
            raw = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            return False
        return raw[raw.rindex(b")") + 2 :][:1] not in (b"Z", b"X")

    def close(self) -> None:
        for fd in self.fds.values():
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


def end(child: subprocess.Popen[Any]) -> None:
    """End ``child`` and every process of its tree, session and group (see the module's
    docstring), and reap ``child``. Bounded: ``GRACE`` + ``GONE`` seconds, and ``GONE`` more
    for a child that does not die even of SIGKILL (a process in uninterruptible sleep)."""
    reaped = child.returncode is not None
    pinned = _Pinned(tree(child.pid, reaped=reaped))
    try:
        pinned.signal(signal.SIGTERM)
        pinned.wait(time.monotonic() + GRACE)
        # What was started meanwhile (a compile forked while /proc was read), and whatever
        # did not end on SIGTERM: killed. The child is not reaped yet, so its pid, session
        # and group are still its own.
        pinned.add(tree(child.pid, reaped=reaped))
        pinned.signal(signal.SIGKILL)
        if not reaped:
            with contextlib.suppress(OSError):
                child.kill()  # a child /proc did not show (another platform): still ended
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=GONE)
        pinned.wait(time.monotonic() + GONE)
    finally:
        pinned.close()
