"""The ``cudaenv`` script (pyproject.toml's ``[project.scripts]``) and ``python -m
builder.cli``: a SIGTERM from the command's first instant is said as an interrupt
(reporter.hold_sigterm), held before the ~0.25 s of the command's imports."""

from __future__ import annotations


def entry() -> int:
    from builder.core import reporter

    reporter.hold_sigterm()
    from builder.cli.main import main

    return main()
