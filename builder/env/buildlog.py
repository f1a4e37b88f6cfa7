"""What a source build's log says: the one line a failed build ends in (the first thing in
it a user can act on), and the heartbeat a long compile prints (ninja's ``[done/total]``, the
time so far, an estimate of the rest)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence

# How often a compile that is still running says so.
HEARTBEAT = 30.0

_COMPILER_ERROR = re.compile(r"(\bfatal error\b|\berror\b:|nvcc fatal\s*:|#error\b)", re.I)
_NOT_COMPILER = re.compile(
    r"^\s*(ERROR: |error: subprocess-exited-with-error|error: command .* failed|"
    r"error: metadata-generation-failed|╰─>|note: )"
)
_EXCEPTION = re.compile(r"^\s*([A-Za-z_.]*(Error|Exception)): (.+)$")
_NETWORK = ("urlopen error", "URLError", "Connection refused", "ProxyError", "Max retries")
_GPU = ("No CUDA GPUs are available", "no CUDA-capable device")


def first_problem(lines: Sequence[str]) -> str | None:
    """What a failed build's log says first that a user can act on: a build that reached for
    the network or a GPU, else the first compiler error, else the last exception raised."""
    text = "\n".join(lines)
    if any(s in text for s in _NETWORK):
        return (
            "the build tried to reach the network, which a source build has closed (a "
            "package that downloads a prebuilt wheel: set its FORCE_BUILD variable in the "
            "spec's build-env)"
        )
    if any(s in text for s in _GPU):
        return "the build asked for a GPU; a source build sees none (CUDA_VISIBLE_DEVICES='')"
    for line in lines:
        if _COMPILER_ERROR.search(line) and not _NOT_COMPILER.match(line):
            return line.strip()[:300]
    for line in reversed(lines):
        found = _EXCEPTION.match(line)
        if found:
            return line.strip()[:300]
    return None


class Watch:
    """A build's heartbeat: every HEARTBEAT seconds one line with ninja's ``[done/total]``,
    the time so far and an estimate of the rest.

    Piped, ninja prints ``[done/total]`` as each step finishes (the console status of a
    terminal is printed as steps start). The estimate is the mean time of the finished
    steps times the steps left, less the time since the last one finished, so it falls
    while ninja works on a step; a step that has taken longer than that is said as such
    ("the last 1 step(s) taking longer than the others"), never as an estimate that grows."""

    _STEP = re.compile(r"\[(\d+)/(\d+)\]")

    def __init__(
        self,
        what: str,
        progress: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.progress, self.clock = what, progress, clock
        self.started = clock()
        self.step: tuple[int, int] | None = None
        self.step_at = 0.0  # seconds from the start to the last step finished
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def line(self, line: str) -> None:
        found = self._STEP.search(line)
        if found:
            step = (int(found.group(1)), int(found.group(2)))
            if step != self.step:
                self.step, self.step_at = step, self.clock() - self.started

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)

    def said(self) -> str:
        elapsed = self.clock() - self.started
        text = f"{self.what}: compiling, {_minutes(elapsed)} so far"
        if self.step is not None:
            done, total = self.step
            text += f", ninja [{done}/{total}]"
            if 0 < done < total:
                left = self.step_at / done * (total - done) - (elapsed - self.step_at)
                if left >= 1:
                    text += f", about {_minutes(left)} left"
                else:
                    text += f", the last {total - done} step(s) taking longer than the others"
        return text

    def _beat(self) -> None:
        while not self.stopped.wait(HEARTBEAT):
            self.progress(self.said())


def _minutes(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"
