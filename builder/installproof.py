"""The proof of an install: every file each installed distribution's RECORD names is there,
inside the env, at the recorded size and (where it must be) hash, and every locked package is
installed at its version. `build` runs it before an env is swapped in (uv can exit 0 over
packages a failed earlier run left half-copied: a full disk).
"""

from __future__ import annotations

import base64
import concurrent.futures
import csv
import hashlib
import os
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.markers import InvalidMarker, Marker, UndefinedComparison, UndefinedEnvironmentName
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder.lock import LockedPackage

# Files above this many bytes in all are hashed by a pool of threads (hashlib releases the GIL
# for large updates); below it, one thread is faster than starting a pool.
_POOL_BYTES = 64 * 2**20
_CHUNK = 2**20


@dataclass(frozen=True, kw_only=True)
class _Recorded:
    """One RECORD row of an installed distribution: the file, its hash and size."""

    dist: str  # the .dist-info directory's name
    rel: str  # as RECORD writes it, relative to site-packages
    path: str  # normalized; strings, not Paths: pathlib costs 2/3 of the proof's time
    algorithm: str | None
    digest: str | None  # urlsafe base64 without padding, as RECORD writes it
    size: int | None


def _digest(path: str, algorithm: str) -> str:
    h = hashlib.new(algorithm)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:  # noqa: PTH123 - a str path (see _Recorded)
        while n := fh.readinto(buf):
            h.update(view[:n])
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def problems(
    site: Path,
    root: Path,
    packages: Sequence[LockedPackage] = (),
    *,
    hash_linked: bool = False,
    wheel_file: Callable[[str, str], Path | None] | None = None,
) -> list[str]:
    """What is not as the RECORD files below ``site`` say; empty when every file is there.

    Each of ``packages`` must have a ``.dist-info`` of its version with a RECORD; every file a
    RECORD names must be inside ``root``, a regular file of the recorded size, and, where
    RECORD gives a hash (RECORD itself and ``.pyc`` files have none, PEP 376), that hash.

    The hash is checked for every file this install wrote (one link: a copy), not for a file
    hard-linked from uv's cache (``st_nlink > 1`` in a tree made this build): a hard link is
    one directory entry made whole or not at all, its bytes are the cache's file, which uv
    unpacked from a wheel whose sha256 matched the lock before renaming it into the cache, so
    an interrupted or out-of-space install cannot leave such a file partly written; its size
    is still checked. Hashing those too would read the whole env on every warm build (266 MiB
    for the toolkit spec, gigabytes for a torch stack: ~0.2 s per 266 MiB on one core); a
    cache changed after uv filled it is a question of the cache's trust, not of this install.
    ``hash_linked`` hashes them all the same. Where uv copies (its cache on another
    filesystem), everything is hashed: about the copy's own cost again (0.3 s of a 0.6 s
    build of the toolkit spec on 2 cores), the price of proving bytes that were written.

    Some published wheels ship a RECORD their own files contradict (pynvvideocodec 2.0.4: two
    ``.so`` files 36191 bytes larger than recorded). A file that differs from RECORD is
    therefore compared with the wheel's own file (``wheel_file(dist_info, rel)``: where uv
    unpacked it, :func:`uv_archive_file`): equal bytes are the wheel's, installed whole."""
    problems: list[str] = []
    infos: dict[str, tuple[str, Path]] = {}
    for info in sorted(site.glob("*.dist-info")):
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        infos[canonicalize_name(name)] = (version, info)
    for pkg in packages:
        found = infos.get(canonicalize_name(pkg.name))
        if found is None:
            problems.append(f"{pkg.name} {pkg.version}: not installed (no .dist-info)")
        elif not _same_version(found[0], pkg.version):
            problems.append(f"{pkg.name}: {found[0]} installed, the lock says {pkg.version}")
    to_hash: list[_Recorded] = []
    site_text, inside = os.fspath(site), os.fspath(root) + os.sep
    claims: dict[str, list[_Recorded]] = {}
    for _version, info in infos.values():
        try:
            text = (info / "RECORD").read_text(encoding="utf-8")
        except OSError as exc:
            problems.append(f"{info.name}/RECORD: {exc.strerror or exc}")
            continue
        for row in csv.reader(text.splitlines()):
            if row and row[0]:
                entry = _entry(site_text, info.name, row)
                claims.setdefault(entry.path, []).append(entry)
    differing: list[tuple[_Recorded, str]] = []
    for entries in claims.values():
        if len(entries) > 1:
            # Two wheels ship one path (flashinfer-python 0.7.2 and torch-c-dlpack-ext 0.1.5
            # both install a top-level build_backend.py): the installer's last write stays,
            # so the file is as recorded when it is any one claimant's.
            problem = _shared_entry_problem(entries, inside)
            if problem is not None:
                problems.append(problem)
            continue
        problem = _check_entry(entries[0], inside, to_hash, hash_linked=hash_linked)
        if problem is not None and any(d in problem for d in _DIFFERS):
            differing.append((entries[0], problem))
        elif problem is not None:
            problems.append(problem)
    differing += _hash_problems(to_hash)
    for entry, problem in differing:
        held = wheel_file(entry.dist, entry.rel) if wheel_file is not None else None
        if held is None or not _same_bytes(Path(entry.path), held):
            problems.append(problem)
    return problems


# How a problem says a file differs from its RECORD (size or hash): such a file may be the
# wheel's own (a RECORD the wheel contradicts), which the caller can ask uv's cache about.
_DIFFERS = ("bytes, RECORD says", "differs from RECORD's")


def _same_bytes(a: Path, b: Path) -> bool:
    try:
        if a.stat().st_size != b.stat().st_size or not b.is_file():
            return False
        return _digest(os.fspath(a), "sha256") == _digest(os.fspath(b), "sha256")
    except OSError:
        return False


def uv_archive_file(cache: Path) -> Callable[[str, str], Path | None]:
    """``wheel_file`` for :func:`problems`: the file ``rel`` as uv unpacked the wheel whose
    ``.dist-info`` is ``dist_info`` into its cache at ``cache`` (``archive-v*/ID/``), or None.
    Only asked for the few files that differ from their RECORD."""

    def find(dist_info: str, rel: str) -> Path | None:
        for archive in sorted(cache.glob(f"archive-v*/*/{dist_info}")):
            candidate = archive.parent / rel
            if candidate.is_file() and not candidate.is_symlink():
                return candidate
        return None

    return find


def _shared_entry_problem(entries: Sequence[_Recorded], inside: str) -> str | None:
    """None when the file several RECORDs name is as one of them records (size, and hash
    where it gives one: always checked here, such paths are few), else the problem."""
    owners = ", ".join(e.dist for e in entries)
    first = entries[0]
    problem = _check_entry(replace(first, size=None), inside, [], hash_linked=False)
    if problem is not None:
        return problem
    size = os.lstat(first.path).st_size
    digests: dict[str, str] = {}
    for e in entries:
        if e.size is not None and e.size != size:
            continue
        if not e.digest or not e.algorithm:
            return None
        if e.algorithm not in hashlib.algorithms_guaranteed:
            continue
        try:
            got = digests.setdefault(e.algorithm, _digest(e.path, e.algorithm))
        except OSError as exc:
            return f"{e.dist}: {e.rel}: {exc.strerror}"
        if got == e.digest:
            return None
    return f"{first.rel}: {size} bytes, as none of the RECORDs that name it say ({owners})"


def applies(pkg: LockedPackage, marker_env: dict[str, str]) -> bool:
    """Whether uv installs ``pkg`` where ``marker_env`` holds; a marker that cannot be read
    counts as holding (the package is then required)."""
    if not pkg.marker:
        return True
    try:
        return Marker(pkg.marker).evaluate({**marker_env, "extra": ""})
    except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName):
        return True


def _same_version(installed: str, locked: str) -> bool:
    try:
        return Version(installed) == Version(locked)
    except InvalidVersion:
        return installed == locked


def _entry(site: str, dist: str, row: list[str]) -> _Recorded:
    algorithm = digest = None
    if len(row) > 1 and "=" in row[1]:
        algorithm, _, digest = row[1].partition("=")
    size = int(row[2]) if len(row) > 2 and row[2].strip().isdigit() else None
    path = os.path.normpath(os.path.join(site, row[0]))  # noqa: PTH118 - see _Recorded.path
    return _Recorded(dist=dist, rel=row[0], path=path, algorithm=algorithm, digest=digest,
                     size=size)  # fmt: skip


def _check_entry(
    entry: _Recorded, inside: str, to_hash: list[_Recorded], *, hash_linked: bool
) -> str | None:
    """None if the file is as RECORD says (its hash left to :func:`_hash_problems`, queued in
    ``to_hash``), else the problem; ``inside``: the env's path and a separator."""
    if not entry.path.startswith(inside):
        return f"{entry.dist}: {entry.rel}: outside the env"
    try:
        st = os.lstat(entry.path)
    except FileNotFoundError:
        return f"{entry.dist}: {entry.rel}: missing"
    except OSError as exc:
        return f"{entry.dist}: {entry.rel}: {exc.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{entry.dist}: {entry.rel}: not a regular file"
    if entry.size is not None and st.st_size != entry.size:
        return f"{entry.dist}: {entry.rel}: {st.st_size} bytes, RECORD says {entry.size}"
    if entry.digest and (hash_linked or st.st_nlink == 1):
        to_hash.append(entry)
    return None


def _hash_problems(entries: Sequence[_Recorded]) -> list[tuple[_Recorded, str]]:
    def check(entry: _Recorded) -> str | None:
        assert entry.algorithm is not None and entry.digest is not None
        if entry.algorithm not in hashlib.algorithms_guaranteed:
            return f"{entry.dist}: {entry.rel}: RECORD names hash {entry.algorithm!r}, unknown"
        try:
            got = _digest(entry.path, entry.algorithm)
        except OSError as exc:
            return f"{entry.dist}: {entry.rel}: {exc.strerror}"
        if got != entry.digest:
            return f"{entry.dist}: {entry.rel}: {entry.algorithm} differs from RECORD's"
        return None

    total = sum(e.size or 0 for e in entries)
    if total < _POOL_BYTES:
        found = [check(e) for e in entries]
    else:
        workers = min(8, os.cpu_count() or 1)
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            found = list(pool.map(check, entries))
    return [(e, p) for e, p in zip(entries, found, strict=True) if p is not None]
