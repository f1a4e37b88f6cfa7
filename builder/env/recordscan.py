"""Every path the RECORD files of a site-packages claim, each looked at once (``lstat``), for
the proof of an install (builder/env/installproof.py): which claims the common case passes
outright (a regular file inside the env, of the recorded size, one of uv's hard links), and
which are left for the proof to judge one by one.

A torch stack's RECORDs name 74,000 files: the ``lstat`` of each is most of the proof, and
all of it is system calls, so a large set is split by distribution across two processes
(builder/core/forked.py), which halves it where a second core is free (0.32 s -> 0.20 s for
the default stack on 2 cores). The answer is the same either way: a path two wheels claim is
found whichever process read each claimant.
"""

from __future__ import annotations

import contextlib
import csv
import gc
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from builder.core import forked

# (dist-info name, RECORD row): one distribution's claim of a path.
Claim = tuple[str, list[str]]
# (path, dist-info name, RECORD row): a claim the common case did not pass.
Slow = tuple[str, str, list[str]]
# A Scanned as the other process sends it (builder/core/forked.py: marshal's kind of data):
# its claims' paths joined by NUL, then shared, slow, tops and unreadable.
Plain = tuple[str, dict[str, list[Claim]], list[Slow], list[str], list[str]]
# RECORDs at least this large in all are read by two processes: below it, the fork costs
# about what the second core saves (the default stack's are 9 MiB, the toolkit spec's 0.2).
SPLIT_BYTES = 2 * 2**20
# How long the second process may still take once this one has read its half (the same
# work): past it, the half is read here again.
SPLIT_TIMEOUT = 120.0


def record_rows(record: Path) -> Iterator[list[str]]:
    """The rows of a RECORD that name a path: the one reader of RECORD files. PEP 376 writes
    it as csv (a path with a comma is quoted, so splitting on ``,`` gives the wrong path) in
    UTF-8; an undecodable byte is replaced, which makes that path one nothing finds (a
    problem where the proof looks for it, never a traceback). The file is read at the call:
    OSError there, not while iterating."""
    text = record.read_text(encoding="utf-8", errors="replace")
    if '"' not in text:
        # No quote: csv's rows are the lines split at each comma (a third of the time).
        return (line.split(",") for line in text.splitlines() if line and line[0] != ",")
    return (row for row in csv.reader(text.splitlines()) if row and row[0])


@dataclass(kw_only=True)
class Scanned:
    """What one read of RECORDs found: ``slow``, the (path, dist, row) claims the common case
    did not pass; ``shared``, every claimant of a path several RECORDs name (judged together,
    never one by one); ``tops``, the entries of site-packages the RECORDs cover; ``unreadable``,
    a problem per RECORD that could not be read."""

    slow: list[Slow] = field(default_factory=list)
    shared: dict[str, list[Claim]] = field(default_factory=dict)
    tops: set[str] = field(default_factory=set)
    unreadable: list[str] = field(default_factory=list)
    claims: dict[str, Claim] = field(default_factory=dict)  # each path's first claimant


def scan(
    site: str, infos: Sequence[tuple[str, Path]], inside: str, *, hash_linked: bool
) -> Scanned:
    """Every claim of the RECORDs of ``infos`` (version, dist-info) below ``site``; ``inside``:
    the env's path and a separator. Split across two processes when large (see above)."""
    with _collector_paused():
        return _scan(site, infos, inside, hash_linked=hash_linked)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while RECORDs are read: each row is a new list kept
    in ``claims``, so every few hundred rows a collection walked the growing set again (the
    default stack's 74,000 rows in one process: 0.44 s with it, 0.38 s without, measured).
    The rows are not cyclic; what they hold is freed by reference counting either way. The
    switch is process-wide: where two reads overlap in threads, the one that found it on
    turns it back on as it ends, so it is on again once both have ended."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _scan(
    site: str, infos: Sequence[tuple[str, Path]], inside: str, *, hash_linked: bool
) -> Scanned:
    sizes = [_size(info / "RECORD") for _v, info in infos]
    if sum(sizes) < SPLIT_BYTES or not forked.can_fork():
        done = _read(site, infos, inside, hash_linked=hash_linked)
    else:
        mine, theirs = _halves(infos, sizes)
        here, there = forked.both(
            lambda: _read(site, mine, inside, hash_linked=hash_linked),
            lambda: _plain(_read(site, theirs, inside, hash_linked=hash_linked)),
            timeout=SPLIT_TIMEOUT,
        )
        done = _merge(here, there, site, theirs)
    # A shared path's first claimant was looked at alone as it was read: judged with all
    # of them instead (installproof's _shared_entry_problem).
    done.slow = [s for s in done.slow if s[0] not in done.shared]
    return done


def _size(record: Path) -> int:
    try:
        return os.lstat(record).st_size
    except OSError:
        return 0


def _halves(
    infos: Sequence[tuple[str, Path]], sizes: Sequence[int]
) -> tuple[list[tuple[str, Path]], list[tuple[str, Path]]]:
    """Two sets of RECORDs of about equal size (largest first, each to the lighter half),
    each in the given order."""
    halves: tuple[list[int], list[int]] = ([], [])
    weight = [0, 0]
    for i in sorted(range(len(infos)), key=lambda i: -sizes[i]):
        lighter = 0 if weight[0] <= weight[1] else 1
        halves[lighter].append(i)
        weight[lighter] += sizes[i]
    return [infos[i] for i in sorted(halves[0])], [infos[i] for i in sorted(halves[1])]


def _read(
    site: str, infos: Sequence[tuple[str, Path]], inside: str, *, hash_linked: bool
) -> Scanned:
    done = Scanned()
    claims, shared, slow, tops = done.claims, done.shared, done.slow, done.tops
    prefix = site + os.sep
    lstat, is_reg = os.lstat, stat.S_ISREG
    for _version, info in infos:
        try:
            rows = record_rows(info / "RECORD")
        except OSError as exc:
            done.unreadable.append(f"{info.name}/RECORD: {exc.strerror or exc}")
            continue
        dist = info.name
        for row in rows:
            path = _path(site, prefix, row[0], tops)
            claim = (dist, row)
            first = claims.setdefault(path, claim)
            if first is not claim:
                # Two wheels ship one path: judged with all its claimants, not as either's.
                shared.setdefault(path, [first]).append(claim)
                continue
            # The common case inline (a call and an object per file were half the proof's
            # time): inside, a regular file of the recorded size, one of uv's hard links.
            try:
                st = lstat(path)
            except OSError:
                st = None
            if (
                st is not None
                and is_reg(st.st_mode)
                and path.startswith(inside)
                and (len(row) < 3 or not row[2] or row[2] == str(st.st_size))
                and (len(row) < 2 or not row[1] or (st.st_nlink > 1 and not hash_linked))
            ):
                continue
            slow.append((path, dist, row))
    return done


def _path(site: str, prefix: str, rel: str, tops: set[str]) -> str:
    """The path a RECORD row names, normalized; its top-level entry of site added to
    ``tops`` where it is inside site."""
    if rel[0] in "/." or "/." in rel or "//" in rel:
        path = os.path.normpath(os.path.join(site, rel))  # noqa: PTH118 - str paths: speed
        if path.startswith(prefix):
            tops.add(path[len(prefix) :].partition(os.sep)[0])
        return path
    tops.add(rel.partition("/")[0])
    return prefix + rel  # already normal: normpath is a third of the time


def _plain(done: Scanned) -> Plain:
    """``done`` as marshal's kind of data, its claims as their paths alone (the rows of the
    few that the other half also claims are read again: :func:`_claimants`)."""
    paths = "\0".join(done.claims)  # no path holds a NUL
    return paths, done.shared, done.slow, sorted(done.tops), done.unreadable


def _merge(here: Scanned, there: Plain, site: str, theirs: Sequence[tuple[str, Path]]) -> Scanned:
    """One Scanned of both halves: a path claimed in each is shared, with every claimant."""
    paths, shared, slow, tops, unreadable = there
    their_paths = set(paths.split("\0")) if paths else set()
    merged = Scanned(
        slow=[*here.slow, *slow],
        shared={p: list(c) for p, c in here.shared.items()},
        tops=here.tops | set(tops),
        unreadable=[*here.unreadable, *unreadable],
    )
    for path, claimants in shared.items():
        mine = here.shared.get(path) or ([here.claims[path]] if path in here.claims else [])
        merged.shared[path] = [*mine, *claimants]
    both = their_paths.intersection(here.claims).difference(shared)
    for path, claimants in _claimants(site, theirs, both).items():
        mine = merged.shared.get(path) or [here.claims[path]]
        merged.shared[path] = [*mine, *claimants]
    return merged


def _claimants(
    site: str, infos: Sequence[tuple[str, Path]], wanted: set[str]
) -> dict[str, list[Claim]]:
    """The claims of ``wanted`` paths in the RECORDs of ``infos``, read again: only RECORDs
    whose text holds a wanted path's last component are parsed (normalizing a path never
    makes up a component, so none is missed)."""
    found: dict[str, list[Claim]] = {}
    if not wanted:
        return found
    prefix = site + os.sep
    names = {p.rpartition(os.sep)[2] for p in wanted}
    for _version, info in infos:
        try:
            text = (info / "RECORD").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if not any(name in text or '"' in name for name in names):
            continue
        for row in record_rows(info / "RECORD"):
            path = _path(site, prefix, row[0], set())
            if path in wanted:
                found.setdefault(path, []).append((info.name, row))
    return found


def shared_objects(record: Path, limit: int) -> list[str]:
    """The paths a RECORD names that are shared objects. Only the lines naming one are
    decoded and read as csv: every row of flashinfer's and tilelang's 10,000-row RECORDs (as
    :func:`record_rows` reads them) cost the doctor 30 ms. Read bounded (``limit`` bytes:
    larger is none) and without following a symlink, unlike record_rows: any file of the env
    may be planted."""
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # a symlink, gone, unreadable: names nothing to judge
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return []
        data = os.read(fd, limit)
    except OSError:
        return []
    finally:
        os.close(fd)
    lines = []
    at = data.find(b".so")
    while at >= 0:
        start, end = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
        end = len(data) if end < 0 else end
        lines.append(data[start:end].decode("utf-8", "replace"))
        at = data.find(b".so", end)
    try:
        rows = list(csv.reader(lines))
    except csv.Error:  # a RECORD csv cannot read names nothing to judge
        return []
    # A NUL names no file (and os.open would raise ValueError for it).
    return [row[0] for row in rows if row and is_shared_object(row[0]) and "\0" not in row[0]]


def is_shared_object(path: str) -> bool:
    name = path.rpartition("/")[2]
    return name.endswith(".so") or ".so." in name
