"""Two parts of one job on two cores: the second part in a forked child, the first in this
process, the child's answer sent back through a pipe as :mod:`marshal` data (plain values
only: str, bytes, int, float, None, and tuples, lists, dicts and sets of them).

For work that is a system call per item (an ``lstat`` of each of the 74,000 files of a torch
stack's RECORDs): threads do not help there (each call takes and gives back the GIL, and
two threads ran no faster than one, measured), two processes halve it. Every failure of the
child (it cannot be forked, it raised, it was killed, it did not answer within ``timeout``)
costs only time: the second part is then run here, so the answer never depends on whether
a fork happened.
"""

from __future__ import annotations

import marshal
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

A = TypeVar("A")
B = TypeVar("B")

# The child's answer is read in chunks of this size.
_CHUNK = 1 << 20


def can_fork() -> bool:
    """Whether a second part may run in a child: a fork is possible, this process has one
    thread (a fork while another thread holds a lock, malloc's or the import system's, can
    leave the child waiting on it forever; Python 3.12 warns of it), and a second core is
    there to run it."""
    if not hasattr(os, "fork") or threading.active_count() != 1:
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores >= 2


def both(first: Callable[[], A], second: Callable[[], B], *, timeout: float) -> tuple[A, B]:
    """``(first(), second())``, with ``second`` run in a forked child where :func:`can_fork`
    allows, at the same time as ``first`` runs here. ``second``'s value must be marshal's kind
    of data; a child that has not answered ``timeout`` seconds after ``first`` returned is
    killed and ``second`` is run here."""
    if not can_fork():
        return first(), second()
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        return first(), second()
    if pid == 0:  # the child: never returns into the caller's code
        _child(second, read_end, write_end)
    os.close(write_end)
    data: bytes | None = None
    try:
        mine = first()
        data = _answer(read_end, pid, time.monotonic() + timeout)
    finally:
        os.close(read_end)
        _reap(pid)
    if data is not None:
        try:
            # Our own child's bytes, through a pipe no other process holds.
            return mine, marshal.loads(data)  # noqa: S302
        except (EOFError, ValueError, TypeError):
            pass
    return mine, second()


def _child(second: Callable[[], Any], read_end: int, write_end: int) -> None:
    """Run ``second``, write its value, and end the process without running anything the
    parent registered (atexit, stdio buffers copied by the fork: they are the parent's to
    flush)."""
    code = 1
    try:
        os.close(read_end)
        payload = memoryview(marshal.dumps(second()))
        while payload:
            payload = payload[os.write(write_end, payload) :]
        code = 0
    except BaseException:  # noqa: S110 - any failure: the parent runs it itself
        pass
    finally:
        os._exit(code)


def _answer(fd: int, pid: int, deadline: float) -> bytes | None:
    """Everything the child wrote, if it wrote all of it and exited 0 by ``deadline``."""
    chunks: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            break
        chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks) if os.waitstatus_to_exitcode(status) == 0 else None


def _reap(pid: int) -> None:
    """The child ended (killed first if it is still running), never left a zombie."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except ChildProcessError:
        pass  # already reaped by _answer
