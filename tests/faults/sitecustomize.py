"""Fault points for the interruption tests, in the processes they start (never in cudaenv).

A test puts this directory on the child's ``PYTHONPATH`` and names a stage in
``CUDAENV_FAULT_PAUSE`` (``overlay``, ``adopt-journal``, ...): the child holds there for
``CUDAENV_FAULT_PAUSE_SECONDS`` (default 30), after saying ``fault point NAME`` on stderr, so
the test can kill it at that stage. cudaenv's own code only calls ``build.fault_point``, whose
hooks list is empty unless this module filled it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

PAUSE = os.environ.get("CUDAENV_FAULT_PAUSE", "")
SECONDS = float(os.environ.get("CUDAENV_FAULT_PAUSE_SECONDS", "30"))


def pause(name: str, progress: Callable[[str], None]) -> None:
    if name == PAUSE:
        progress(f"fault point {name}: pausing {SECONDS:g} s")
        time.sleep(SECONDS)


def install() -> None:
    try:
        from builder.env import build
    except ImportError:
        return  # an interpreter the child started (an env's) without cudaenv's dependencies
    build.FAULT_HOOKS.append(pause)


if PAUSE:
    install()
