"""The index view a resolution sees: the package index as it stood at one moment.

A package index only grows, so "what it held at time T" is a fixed answer wherever the index
serves each file's upload time (PEP 700): uv's ``--exclude-newer T`` leaves out every file
uploaded at or after T. A lock records the view it was resolved against (``[tool.cudaenv]
exclude-newer``), and a re-lock resolves with it, so a release published later changes
nothing until the user moves the view (``cudaenv lock --upgrade``, ``--upgrade-package``).

Two exceptions, each one a rule of uv's own:
- a file its index gives no upload time (a wheelhouse, ``file://`` pages, a mirror without
  PEP 700) would be left out by any cut-off, so a package whose locked files carry none is
  exempt (``--exclude-newer-package NAME=false``): its pin alone keeps it;
- one package may have a view of its own (``--exclude-newer-package NAME=T``): the one
  ``--upgrade-package NAME`` moved, or one the spec names for the first time.

Times are UTC, written ``2026-12-01T05:23:12Z`` (RFC 3339, whole seconds), as uv writes them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

# What `--exclude-newer` and CUDAENV_EXCLUDE_NEWER take, for messages.
SPELLINGS = "a UTC time like 2026-12-01T05:23:12Z, or a date like 2026-12-01 (its 00:00 UTC)"


def parse(text: str) -> dt.datetime:
    """``text`` as a moment in UTC; ValueError saying what is taken otherwise. A date alone is
    its first moment in UTC (releases of the days before it); a time without a zone is
    refused, as it would mean another moment on each machine."""
    value = text.strip()
    try:
        if len(value) == 10:
            day = dt.date.fromisoformat(value)
            return dt.datetime(day.year, day.month, day.day, tzinfo=dt.timezone.utc)
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(f"not {SPELLINGS}") from None
    if when.tzinfo is None:
        raise ValueError(f"a time without a zone; write {SPELLINGS}")
    return when.astimezone(dt.timezone.utc)


def problem(text: str) -> str | None:
    """Why ``text`` is not a view's time; None when it is one."""
    try:
        parse(text)
    except ValueError as exc:
        return str(exc)
    return None


def spell(when: dt.datetime) -> str:
    """``when`` as a lock and uv write it: UTC, whole seconds (a part second is dropped)."""
    return when.astimezone(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def canonical(text: str) -> str:
    """``text`` (any spelling :func:`parse` takes) as :func:`spell` writes it."""
    return spell(parse(text))


def now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def after(times: Iterable[str]) -> str | None:
    """The first whole second after every upload time in ``times`` (None when there is none):
    the view under which each of those files is seen (uv leaves out a file uploaded at the
    cut-off itself)."""
    latest: dt.datetime | None = None
    for text in times:
        try:
            when = parse(text)
        except ValueError:
            continue
        latest = when if latest is None or when > latest else latest
    if latest is None:
        return None
    return spell(latest.replace(microsecond=0) + dt.timedelta(seconds=1))


@dataclass(frozen=True, kw_only=True)
class View:
    """What a resolution is told of the index's history.

    ``at``: the cut-off (None: the index as it is now, no cut-off); ``packages``: (name,
    cut-off) of the packages with a view of their own; ``exempt``: packages whose files carry
    no upload time; ``moving``: packages seen as they are now this once (``--upgrade-package``,
    a package new to the spec), given a view of their own by the new lock; ``origin``: where
    ``at`` came from, as ``plan`` and ``lock`` say it."""

    at: str | None = None
    packages: tuple[tuple[str, str], ...] = ()
    exempt: tuple[str, ...] = ()
    moving: tuple[str, ...] = ()
    origin: str = "the index as it is now"

    def uv_args(self) -> list[str]:
        """uv's flags for this view (``uv pip compile``)."""
        if self.at is None:
            return []
        args = ["--exclude-newer", self.at]
        for name, when in self.packages:
            args += ["--exclude-newer-package", f"{name}={when}"]
        for name in sorted({*self.exempt, *self.moving}):
            args += ["--exclude-newer-package", f"{name}=false"]
        return args

    def describe(self) -> str:
        """``2026-12-01T05:23:12Z (kept from the lock)``, and the packages seen otherwise."""
        said = f"{self.at} ({self.origin})" if self.at else self.origin
        if self.packages:
            said += "; " + ", ".join(f"{n} as of {w}" for n, w in self.packages)
        if self.moving:
            said += "; " + ", ".join(self.moving) + " as of now"
        return said
