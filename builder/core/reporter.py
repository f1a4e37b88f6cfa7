"""Where a run's progress goes, and what an interrupt would leave.

One object is made by whoever starts a run (the CLI, a matrix cell) and passed down to the
stages that report, instead of module-level switches: a quiet CLI run, a matrix cell writing
its own log and a test each hold their own, and two of them never see each other's state.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType
from typing import TextIO

from builder.core import descendants
from builder.core.errors import CudaenvError, error_lines, printable, printable_block

NOTHING_BUILT = "nothing was built"


@dataclass
class Reporter:
    """Progress lines (``cudaenv: ...`` on stderr unless ``quiet``) and the note an interrupt
    prints: set by the build as it goes, so the message after the swap names the new env
    instead of promising the old one is still there."""

    quiet: bool = False
    stream: TextIO | None = None  # None: sys.stderr as it is when a line is written
    interrupt_note: str = field(default=NOTHING_BUILT)

    def __call__(self, msg: str) -> None:
        """Report one progress line; a Reporter is a ``Callable[[str], None]``."""
        if not self.quiet:
            out = self.stream or sys.stderr
            print(f"cudaenv: {printable_block(msg)}", file=out, flush=True)

    def leaves(self, note: str) -> None:
        """What an interrupt from now on leaves behind."""
        self.interrupt_note = note


def silent() -> Reporter:
    """A reporter that says nothing (library calls and tests)."""
    return Reporter(quiet=True)


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C, SIGTERM, SIGHUP (the terminal closed): every child cudaenv started, each in a
    session of its own that no terminal signal reaches, is ended with what it started first
    (core/descendants.py), then the signal becomes an exception so a build's cleanup runs
    (build.py). Ending them here, not after the exception unwinds, matters where a worker
    thread waits on a child: a thread pool's exit joins those threads before any handler
    further out runs."""
    descendants.end_all()
    raise KeyboardInterrupt(f"signal {signum}")


# The signals a command's main turns into an interrupt.
_INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


_HELD: list[int] = []


def _hold(signum: int, frame: FrameType | None) -> None:
    _HELD.append(signum)


def hold_sigterm() -> None:
    """From the command's first instant (its entry point, before the ~0.25 s of imports) a
    SIGTERM is kept for :func:`run_main`, which says it as an interrupt: killed that early,
    cudaenv still prints its one line and exits 130, not 143 in silence."""
    signal.signal(signal.SIGTERM, _hold)


def _stdout_gone() -> int:
    # The reader left (`cudaenv plan SPEC | head -1`). As a shell tool would, stop quietly
    # (128 + SIGPIPE), and point stdout at /dev/null so the interpreter's own flush at exit
    # does not fail again (Python's documented recipe, "Note on SIGPIPE").
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def flushed(code: int) -> int:
    """``code``, once what was printed has reached stdout; 141 where its reader has left.

    Output to a pipe is block-buffered: a command's print usually only fills the buffer, and
    the write that meets the closed pipe is the interpreter's flush at exit, after main has
    returned, where no handler runs ("Exception ignored ... BrokenPipeError", exit 120). So
    every way out of a process's main flushes here first."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        return _stdout_gone()
    return code


def run_main(body: Callable[[], int], reporter: Reporter, *, debug: bool = False) -> int:
    """A process's main (the CLI, a matrix cell): run ``body`` with SIGINT, SIGTERM and SIGHUP
    each ending cudaenv's children and then turned into an interrupt; an error becomes one ``error:`` line per problem on stderr and its exit code
    (with ``debug``, the traceback before it), an interrupt 130 and what it left; a reader of
    stdout that left early 141, however far the output got (:func:`flushed`)."""
    # A signal the process was started ignoring stays ignored (`nohup` ignores SIGHUP, a
    # shell's background job SIGINT), as a shell's own children keep it.
    before = {
        signum: signal.signal(signum, _on_interrupt)
        for signum in _INTERRUPTS
        if signum == signal.SIGTERM or signal.getsignal(signum) is not signal.SIG_IGN
    }
    try:
        try:
            if _HELD:  # a SIGTERM while the command was starting
                raise KeyboardInterrupt(f"signal {_HELD[0]}")
            code = body()
        finally:
            # Failed while a worker thread waits on a child: that child and everything it
            # started end here, so the thread's wait returns.
            descendants.end_all()
            # A main called in a process that goes on (a test, a matrix cell's runner) gives
            # the signals back as it found them.
            for signum, handler in before.items():
                signal.signal(signum, handler)
    except CudaenvError as exc:
        if debug:  # the traceback too, and still the documented code: scripts branch on it
            traceback.print_exc(file=sys.stderr)
        for line in error_lines(exc):
            print(line, file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:
        print(f"error: interrupted; {printable(reporter.interrupt_note)}", file=sys.stderr)
        code = 130
    except BrokenPipeError:
        return _stdout_gone()
    return flushed(code)
