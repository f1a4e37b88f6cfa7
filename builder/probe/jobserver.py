"""The compile slots of a warm (builder/probe/jit_warm.py): a GNU make jobserver that every
ninja the warm starts joins, the lead module's head start, and the loans of slots a ninja
holds idle. Standard library only: it runs in the target env's interpreter beside jit_warm.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select as selectors
import shutil
import struct
import tempfile
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

# The warm's compile slots (Jobserver): how long a token the lead module's ninja gave back is
# left to it before another worker takes it (ninja asks again in the same step, within
# milliseconds), how often the slots in use are counted, and how long the other workers wait
# at most for the lead's ninja to start (its key and lock come first: seconds).
GRACE = 0.5
PERIOD = 0.5
LEAD_START = 60.0
# How long tokens must stay missing, at every look, before ``Jobserver.recover`` writes them.
LOST_AFTER = 1.0


class Jobserver:
    """The compile slots of one warm: a GNU make jobserver (a FIFO holding one token a slot)
    that every ninja the warm starts joins, so the modules built at once never run more
    compiles together than there are slots, and a module left alone gets them all. Each
    module's ninja runs on a token its worker took (make's implicit token) and takes one more
    for each further compile.

    Two things ninja's client does are answered here (ninja 1.13's ``build.cc`` and
    ``jobserver-posix.cc``; ninja-build/ninja#2683):

    - It asks for a token only when it can start a command: at its start and when one of its
      own commands ends, never while it waits. A worker waiting in ``select`` takes a token
      the moment it is written, so a module's ninja that began with one slot kept one: topk's
      long file (csrc/cub_topk.cu, ~690 s of its ~700) started behind a short one. So the
      lead module (the first of jit_warm's ``order``) starts alone: the other workers wait until its
      ninja runs commands (it has then taken what it can), it ends, or ``LEAD_START`` passes,
      and while it runs they leave a token written to the FIFO for ``GRACE`` seconds first,
      so its ninja, which gives a token back and asks again in the same step, keeps it.
    - Its first command runs on the implicit slot, and that slot, not the token it read, is
      freed when that command ends. A ninja whose last command runs on a token it read holds
      two slots for one compile (topk's long file is its second). ``balance`` counts the
      compiles that really run (the commands of this process's ninjas, in /proc) against the
      tokens held, lends a token to the FIFO for each slot held idle, and takes the loans
      back as they return: while any is out, it watches the FIFO and every worker gives way
      to it, so a returned token is not a compile too many for long.
    """

    def __init__(self, slots: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="cudaenv-jobs-")
        self.path = os.path.join(self.dir, "fifo")
        os.mkfifo(self.path, 0o600)
        # Read and write ends held open here: no reader or writer ever blocks on open. A
        # token a killed ninja held is gone with it (a FIFO keeps no account of readers):
        # ``recover`` writes it again.
        self.fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)
        os.write(self.fd, b"+" * slots)
        self.slots = slots
        # Guards the counts below and every use of the FIFO by the balancer and by close().
        self.lock = threading.Lock()
        self.held = 0  # tokens the workers hold, each a module's implicit slot
        self.lent = 0  # tokens written beyond the slots, for slots held idle
        self.owed = 0  # loans to take back as soon as a token is free
        self.lending = True  # off for good once a look at /proc has failed
        self.idle_before = 0
        self.free_seen = -1  # tokens in the FIFO at the last look
        self.lost_since: float | None = None  # when tokens were first seen missing
        self.lost_least = 0  # the fewest missing at any look since
        self.lead_since = time.monotonic()  # the lead's start, once ``lead`` says it
        self.lead_running = threading.Event()
        self.opened = threading.Event()  # the other workers may take tokens
        self.closed = threading.Event()
        self.balancer = threading.Thread(target=self.balance, daemon=True)
        self.balancer.start()

    def makeflags(self) -> str:
        return f" -j{self.slots} --jobserver-auth=fifo:{self.path}"

    def free(self) -> int:
        """Tokens in the FIFO now."""
        count = fcntl.ioctl(self.fd, termios.FIONREAD, b"\0\0\0\0")
        return int(struct.unpack("i", count)[0])

    def lead(self, running: bool) -> None:
        """The lead module starts (``True``) or ends."""
        if running:
            self.lead_since = time.monotonic()
            self.lead_running.set()
        else:
            self.lead_running.clear()
            self.opened.set()

    def take(self, beat: Any, behind_lead: bool = False) -> bytes:
        """One token, waiting as long as it takes (every compile gives its token back);
        ``beat`` is called every minute of the wait. ``behind_lead``: a module other than the
        lead, which waits for the lead's start and lets its ninja go first."""
        started = time.monotonic()
        beats = 0

        def heartbeat() -> None:
            nonlocal beats
            waited = time.monotonic() - started
            if waited >= (beats + 1) * 60.0:
                beats = int(waited // 60.0)
                beat(float(beats * 60))

        while behind_lead and not self.opened.wait(1.0):
            heartbeat()
        while True:
            ready, _, _ = selectors.select([self.fd], [], [], 1.0)
            if ready and ((behind_lead and self.lead_running.is_set()) or self.lent > 0):
                # The lead's ninja gives a token back and asks again in one step; a loan
                # come back is the balancer's to take: either goes first.
                time.sleep(GRACE)
            if ready:
                try:
                    token = os.read(self.fd, 1)
                except BlockingIOError:
                    token = b""  # another worker or a ninja took it first
                if token:
                    with self.lock:
                        if self.owed > 0:  # a loan come back: kept out of the FIFO
                            self.owed -= 1
                            self.lent -= 1
                            continue
                        self.held += 1
                    return token
            heartbeat()

    def give(self, token: bytes) -> None:
        with self.lock:
            self.held -= 1
        os.write(self.fd, token)

    def balance(self) -> None:
        """Every ``PERIOD`` (and as soon as a token is written while a loan is out): open the
        way for the other workers once the lead's ninja runs commands, and keep as many
        compiles running as there are slots (see the class)."""
        pause = PERIOD
        while not self.closed.wait(pause):
            try:
                self.look()
            except Exception:  # no look may leave loans out or the way shut
                self.opened.set()
                with self.lock:
                    self.lending = False
                    with contextlib.suppress(OSError):
                        self.settle(0, 0)
            pause = PERIOD
            if self.lent > 0 and self.free_seen == 0:
                # A loan is out and the FIFO was empty: a token written now may be a loan
                # come back, taken back before a ninja or a worker reads it.
                try:
                    ready, _, _ = selectors.select([self.fd], [], [], PERIOD)
                except (OSError, ValueError):
                    return  # closed under it: the warm has ended
                pause = 0.05 if ready else 0.0  # the ninja that wrote it has started its next

    def look(self) -> None:
        """One count of the compiles running: the gate, then a loan or a loan taken back."""
        try:
            running: dict[int, int] | None = census(os.getpid())
        except OSError:  # no /proc here, or unreadable this time: no loan on a guess
            running = None
        commands = sum(running.values()) if running else 0
        if not self.opened.is_set() and (
            commands > 0 or time.monotonic() - self.lead_since > LEAD_START
        ):
            self.opened.set()  # running commands: its ninja has taken what it can
        with self.lock:
            if self.closed.is_set():
                return
            self.free_seen = self.free()
            if running is not None:
                self.recover(running, self.free_seen)
            if running is None or not self.lending:
                self.settle(0, 0)  # every loan taken back, none made
                return
            self.settle(*self.idle(running, self.free_seen))

    def recover(self, running: dict[int, int], free: int) -> None:
        """Write again the tokens a ninja took with it when it was killed (SIGKILL, an
        out-of-memory kill): without them a worker waits for a slot that never comes back.
        Every token is in the FIFO, held by a worker, or held by a live ninja for a command it
        runs (at most one for each: ``running`` counts them), so what is missing beyond that
        bound is lost; written again only when every look for ``LOST_AFTER`` seconds says so
        (the fewest it found missing), never for the moment between a worker's read and its
        count or a ninja's command ending and its token coming back. The lock held."""
        lost = self.slots + self.lent - self.held - free - sum(running.values())
        now = time.monotonic()
        if lost <= 0:
            self.lost_since, self.lost_least = None, 0
            return
        if self.lost_since is None:
            self.lost_since, self.lost_least = now, lost
            return
        self.lost_least = min(self.lost_least, lost)
        if now - self.lost_since >= LOST_AFTER:
            os.write(self.fd, b"+" * self.lost_least)
            self.free_seen += self.lost_least
            self.lost_since, self.lost_least = None, 0

    def idle(self, running: dict[int, int], free: int) -> tuple[int, int]:
        """(slots held idle, loans wanted) for ``running`` (each ninja's commands) and
        ``free`` tokens in the FIFO; the lock held."""
        # A worker's token with no ninja of its own is a slot in use (generating a module,
        # hashing, storing); one with a ninja is used by its commands.
        busy = sum(running.values()) + max(0, self.held - len(running))
        idle = self.slots + self.lent - free - busy
        # Idle twice running (not a moment's gap between two commands), and never more loans
        # than ninjas running a command (each can hold one slot idle): a count gone wrong
        # lends nothing rather than doubling the compiles.
        wanted = min(idle, self.idle_before, sum(1 for n in running.values() if n > 0))
        self.idle_before = idle
        return idle, max(0, wanted)

    def settle(self, idle: int, wanted: int) -> None:
        """Lend up to ``wanted`` loans, or take back those beyond ``idle``; the lock held."""
        if wanted > self.lent:
            os.write(self.fd, b"+" * (wanted - self.lent))
            self.lent = wanted
            self.owed = 0
        elif idle < self.lent:
            self.owed = self.lent - max(0, idle)
            while self.owed > 0:
                try:
                    if not os.read(self.fd, 1):
                        break
                except BlockingIOError:
                    break  # in use: taken back by the next worker that reads it
                self.owed -= 1
                self.lent -= 1

    def close(self) -> None:
        self.closed.set()
        self.opened.set()
        self.balancer.join(timeout=PERIOD * 4)
        with self.lock:  # the balancer never uses the FIFO after this
            os.close(self.fd)
        shutil.rmtree(self.dir, ignore_errors=True)


def census(me: int) -> dict[int, int]:
    """The ``ninja`` processes whose parent is ``me``, each with the number of processes
    whose parent it is (each a command it runs), from /proc. Where such a ``ninja`` runs a
    ``ninja`` (a wrapper script that starts the real one), the inner one's commands count.
    Read from each process's ``children`` lists (a few files), or, on a kernel without them,
    from every process's ``stat``."""
    try:
        children, comm = _children_lists(me)
    except OSError:
        children, comm = _process_table()
    ninjas: dict[int, int] = {}
    for pid in children(me):
        if comm(pid) != "ninja":
            continue
        below = children(pid)
        inner = [c for c in below if comm(c) == "ninja"]
        ninjas[pid] = sum(len(children(c)) for c in inner) if inner else len(below)
    return ninjas


# (pid -> the pids whose parent it is, pid -> its command name)
Lookup = tuple[Callable[[int], list[int]], Callable[[int], str]]


def _children_lists(me: int) -> Lookup:
    """Lookups from /proc/PID/task/TID/children (one list a thread: the warm's ninjas are
    started by its worker threads); OSError where the kernel has none."""
    if not os.path.exists(f"/proc/{me}/task/{me}/children"):
        raise FileNotFoundError(f"/proc/{me}/task/{me}/children")

    def children(pid: int) -> list[int]:
        found: list[int] = []
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return found  # ended while we looked
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children", "rb") as listed:
                    found += [int(c) for c in listed.read().split()]
            except (OSError, ValueError):
                continue
        return found

    def comm(pid: int) -> str:
        try:
            with open(f"/proc/{pid}/comm", "rb") as named:
                return named.read().decode("utf-8", "replace").rstrip("\n")
        except OSError:
            return ""

    return children, comm


def _process_table() -> Lookup:
    """Lookups from every process's /proc/PID/stat."""
    parents: dict[int, tuple[int, str]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                text = stat.read().decode("utf-8", "replace")
        except OSError:
            continue  # ended while we looked
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        head, _, rest = text.rpartition(")")
        fields = rest.split()
        if len(fields) < 2 or not fields[1].isdigit():
            continue
        parents[int(entry.name)] = (int(fields[1]), head.partition("(")[2])
    below: dict[int, list[int]] = {}
    for pid, (ppid, _) in parents.items():
        below.setdefault(ppid, []).append(pid)
    return (lambda pid: below.get(pid, [])), (lambda pid: parents.get(pid, (0, ""))[1])
