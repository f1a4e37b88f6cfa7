"""Where a run's progress goes, and what an interrupt would leave.

One object is made by whoever starts a run (the CLI, a matrix cell) and passed down to the
stages that report, instead of module-level switches: a quiet CLI run, a matrix cell writing
its own log and a test each hold their own, and two of them never see each other's state.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO

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
            print(f"cudaenv: {msg}", file=out, flush=True)

    def leaves(self, note: str) -> None:
        """What an interrupt from now on leaves behind."""
        self.interrupt_note = note


def silent() -> Reporter:
    """A reporter that says nothing (library calls and tests)."""
    return Reporter(quiet=True)
