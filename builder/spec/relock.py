"""What a lock hands on to the next resolution: the versions a re-lock prefers (uv's
preferences file), the index view it resolves against and the view the new lock records,
and the lines that say what a re-lock changed.

Running the resolution is :mod:`builder.spec.resolve`'s.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from packaging.utils import canonicalize_name

from builder.core import indexview, settings
from builder.core.errors import BuildError, LockUnreadable
from builder.formats import tomlwriter
from builder.spec.envspec import EnvSpec
from builder.spec.lock import LOCK_VERSION_LINE, Lock, LockedFile, LockedPackage
from builder.spec.lock import read as read_lock


def preferences(previous: Lock, platform: str) -> bytes:
    """The versions ``previous`` installs on ``platform``, as the PEP 751 file uv reads back
    as its preferences when it is the output file (names and versions are all uv takes from
    it). One platform's entries only: where a lock holds two versions of a package, one per
    platform, uv would prefer whichever came last."""
    lines = [LOCK_VERSION_LINE, tomlwriter.pair("created-by", "cudaenv")]
    for p in previous.packages:
        if p.on(platform):
            lines += ["", "[[packages]]", tomlwriter.pair("name", p.name)]
            lines.append(tomlwriter.pair("version", p.version))
    return ("\n".join(lines) + "\n").encode()


def previous_versions(previous: Path | None, spec: EnvSpec) -> Lock | None:
    """The lock a re-lock keeps the versions of: ``previous`` when it exists and parses (a
    lock that does not parse holds no versions worth keeping; the re-lock replaces it)."""
    if previous is None or not previous.is_file():
        return None
    try:
        return read_lock(previous, spec=spec)
    except (BuildError, LockUnreadable):
        return None


def choose_view(
    previous: Lock | None,
    spec: EnvSpec,
    *,
    upgrade: bool = False,
    upgrade_packages: Sequence[str] = (),
    given: str | None = None,
) -> indexview.View:
    """The index view a (re-)lock of ``spec`` resolves against.

    - ``given`` (``--exclude-newer``): that time.
    - a fresh lock, or ``upgrade``: CUDAENV_EXCLUDE_NEWER where it is set, else the index as
      it is now (the lock then records when that was).
    - a re-lock: the view of ``previous`` (``Lock.view``): a release uploaded since is not
      seen. A package of ``upgrade_packages``, and one the spec's ``packages:`` name that
      ``previous`` does not hold (what `cudaenv add` writes), is seen as it is now and gets
      a view of its own in the new lock.

    A package the spec pins to a ``file://`` index is exempt: a directory has no upload times
    (PEP 700 is an HTTP API's), and uv excludes a file without one under any cut-off."""
    own = {canonicalize_name(n) for n, url in spec.indexes if url.startswith("file:")}
    exempt = tuple(sorted(own.union(previous.view().exempt if previous is not None else ())))
    kept = previous.view() if previous is not None and not upgrade else indexview.View()
    if given is not None or kept.at is None:
        return replace(fresh_view(given), exempt=exempt)
    assert previous is not None
    held = {canonicalize_name(p.name) for p in previous.packages}
    named = {canonicalize_name(_requirement_name(r)) for r in spec.packages}
    moving = {canonicalize_name(n) for n in upgrade_packages} | (named - held)
    return replace(
        kept,
        packages=tuple((n, w) for n, w in kept.packages if n not in moving),
        exempt=exempt,
        moving=tuple(sorted(moving)),
    )


def fresh_view(given: str | None = None) -> indexview.View:
    """The view of a resolution that keeps none: ``given`` (``--exclude-newer``), else
    CUDAENV_EXCLUDE_NEWER, else the index as it is now."""
    if given is not None:
        return indexview.View(at=indexview.canonical(given), origin="given by --exclude-newer")
    found = settings.current().exclude_newer
    if found is not None:
        return indexview.View(at=indexview.canonical(found), origin="CUDAENV_EXCLUDE_NEWER")
    return indexview.View(origin=f"the index as it is now, {indexview.spell(indexview.now())}")


def _requirement_name(text: str) -> str:
    """The project name a PEP 508 requirement of the spec names (the spec has checked it)."""
    return re.split(r"[\s\[<>=!~;@(]", text.strip(), maxsplit=1)[0]


def recorded_view(
    view: indexview.View, packages: Sequence[LockedPackage], begun: dt.datetime
) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """What the new lock records of ``view`` (its cut-off, the packages' own): its cut-off, or, where the index was seen as it
    is now, the moment the resolution began, moved past every upload time it found (a file
    uploaded while uv ran is in the lock, so the view must hold it). Nothing where no file
    carries an upload time (an index without PEP 700: no cut-off could see its files)."""

    def stamp(files: Sequence[LockedFile]) -> str | None:
        times = [f.upload_time for f in files if f.upload_time]
        if not times:
            return None
        latest = indexview.after(times)
        start = indexview.spell(begun)
        return max(start, latest) if latest is not None else start

    everything = [f for p in packages for f in p.files]
    at = view.at if view.at is not None else stamp(everything)
    own = dict(view.packages)
    for name in view.moving:
        mine = stamp([f for p in packages if canonicalize_name(p.name) == name for f in p.files])
        if mine is not None and at is not None and mine > at:
            own[name] = mine
    return at, (tuple(sorted(own.items())) if at is not None else ())


def moved(before: Lock, after: Lock) -> list[str]:
    """What a re-lock changed, one line per package: ``vllm 0.33.0 -> 0.34.0``, ``new: x 1.0``,
    ``gone: y 2.0`` (each platform's versions, named with the platform where they differ)."""
    lines: list[str] = []
    platforms_ = list(dict.fromkeys([*after.platforms, *before.platforms]))
    changes: dict[str, list[str]] = {}
    for platform in platforms_:
        old = (
            {p.name: p.version for p in before.packages_on(platform)}
            if platform in before.platforms
            else {}
        )
        new = (
            {p.name: p.version for p in after.packages_on(platform)}
            if platform in after.platforms
            else {}
        )
        for name in sorted(old.keys() | new.keys()):
            if old.get(name) == new.get(name):
                continue
            if name not in old:
                said = f"new: {name} {new[name]}"
            elif name not in new:
                said = f"gone: {name} {old[name]}"
            else:
                said = f"{name} {old[name]} -> {new[name]}"
            changes.setdefault(said, []).append(platform)
    for said, where in changes.items():
        lines.append(said if len(where) == len(platforms_) else f"{said} (on {', '.join(where)})")
    return lines
