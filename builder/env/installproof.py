"""The proof of an install: every file each installed distribution's RECORD names is there,
inside the env, at the recorded size and (where it must be) hash, and every locked package is
installed at its version. `build` runs it before an env is swapped in (uv can exit 0 over
packages a failed earlier run left half-copied: a full disk).
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import os
import shutil
import stat
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from packaging.markers import InvalidMarker, Marker, UndefinedComparison, UndefinedEnvironmentName
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder.core.errors import BuildError
from builder.env import recordscan
from builder.env.recordscan import record_rows
from builder.spec.lock import LockedPackage

__all__ = ["RECORD_ERRATA", "Proof", "applies", "problems", "prove", "record_rows", "same_version"]

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
    made_before: Iterable[str] = (),
    apart: Collection[str] = (),
    only: Collection[str] | None = None,
    errata: Mapping[tuple[str, str, str], tuple[int, str]] | None = None,
) -> list[str]:
    """What is not as the RECORD files below ``site`` say; empty when every file is there.

    Each of ``packages`` must have a ``.dist-info`` of its version with a RECORD; every file a
    RECORD names must be inside ``root``, a regular file of the recorded size, and, where
    RECORD gives a hash (RECORD itself and ``.pyc`` files have none, PEP 376), that hash.
    Every entry of ``site`` itself must be named by a RECORD or in ``made_before`` (what was
    there before the install: the venv's own files): a ``.pth`` no RECORD lists, planted in
    a cached package tree, would run at every interpreter start.

    The hash is checked for every file this install wrote (one link: a copy), and for every
    file whose size differs from RECORD's; not for a file of the recorded size hard-linked
    from uv's cache (``st_nlink > 1`` in a tree made this build): a hard link is one
    directory entry made whole or not at all, its bytes are the cache's file, which uv
    unpacked from a wheel whose sha256 matched the lock before renaming it into the cache, so
    an interrupted or out-of-space install cannot leave such a file partly written. Hashing
    those too would read the whole env on every warm build (266 MiB for the toolkit spec,
    gigabytes for a torch stack: ~0.2 s per 266 MiB on one core); a cache changed after uv
    filled it is a question of the cache's trust (its owner and mode are checked), not of
    this install. ``hash_linked`` hashes them all the same. Where uv copies (its cache on
    another filesystem), everything is hashed: about the copy's own cost again.

    The reference is always RECORD, never uv's cached copy of the same file (one inode with
    the env's: a file cut short in the cache would vouch for itself). A few published wheels
    ship a RECORD their own files contradict; ``errata`` (default :data:`RECORD_ERRATA`)
    names those files by (dist-info, path, RECORD's digest) with the size and sha256 the
    wheel really holds, measured from wheels whose hash matched their lock.

    ``apart``: entries of ``site`` that another install is writing while this proof reads
    (a wheel taken from the store, builder/env/sourcebuild.py): neither read nor counted here,
    since a ``.dist-info`` may not have its RECORD yet; the proof of that install judges them.
    ``only``: the entries of ``site`` that install added (its ``.dist-info`` the only RECORD
    read), where the rest of ``site``, in ``made_before``, was proven before and nothing has
    run in the env since."""
    errata = RECORD_ERRATA if errata is None else errata
    # Absolute and normal: a RECORD row with a dot segment is normalized before it is
    # compared with ``root``, so an env named `../env` would see its own files as outside.
    # Not resolve(): a row's path keeps its links too, and must be compared with the same.
    site = Path(os.path.abspath(site))  # noqa: PTH100 - links kept
    root = Path(os.path.abspath(root))  # noqa: PTH100 - links kept
    infos, problems = _installed(site, packages, apart, only)
    site_text, inside = os.fspath(site), os.fspath(root) + os.sep
    found = recordscan.scan(site_text, list(infos.values()), inside, hash_linked=hash_linked)
    problems += found.unreadable
    known = {*made_before, *apart, *(i.name for _v, i in infos.values())}
    problems += _unlisted(site, found.tops, known)
    file_problems, to_hash, differing = _judge(found.slow, inside, hash_linked=hash_linked)
    problems += file_problems
    for path, claimants in sorted(found.shared.items()):
        # Two wheels ship one path (flashinfer-python 0.7.2 and torch-c-dlpack-ext 0.1.5
        # both install a top-level build_backend.py): the installer's last write stays,
        # so the file is as recorded when it is any one claimant's.
        entries = [_entry(dist, row[0], path, row) for dist, row in sorted(claimants)]
        problem = _shared_entry_problem(entries, inside)
        if problem is not None:
            problems.append(problem)
    problems += [p for _e, p in _hash_problems(to_hash)]
    problems += [p for e, p in differing if not _as_erratum(e, errata)]
    return problems


def _installed(
    site: Path,
    packages: Sequence[LockedPackage],
    apart: Collection[str] = (),
    only: Collection[str] | None = None,
) -> tuple[dict[str, tuple[str, Path]], list[str]]:
    """The ``.dist-info`` directories below ``site`` (but those ``apart``, or only those in
    ``only``) by canonical name (with the version each names), and the problems of
    ``packages`` that are missing or at another version."""
    problems: list[str] = []
    infos: dict[str, tuple[str, Path]] = {}
    for info in sorted(site.glob("*.dist-info")):
        if info.name in apart or (only is not None and info.name not in only):
            continue
        name, _, version = info.name[: -len(".dist-info")].partition("-")
        infos[canonicalize_name(name)] = (version, info)
    for pkg in packages:
        found = infos.get(canonicalize_name(pkg.name))
        if found is None:
            problems.append(f"{pkg.name} {pkg.version}: not installed (no .dist-info)")
        elif not same_version(found[0], pkg.version):
            problems.append(f"{pkg.name}: {found[0]} installed, the lock says {pkg.version}")
    return infos, problems


def _judge(
    slow: Sequence[recordscan.Slow], inside: str, *, hash_linked: bool
) -> tuple[list[str], list[_Recorded], list[tuple[_Recorded, str]]]:
    """The claims the common case did not pass, each judged: the problems found, the entries
    whose hash is still to be checked, and those whose size differs from RECORD's (with the
    problem to say unless they are a known erratum)."""
    problems: list[str] = []
    to_hash: list[_Recorded] = []
    differing: list[tuple[_Recorded, str]] = []
    for path, dist, row in slow:
        entry = _entry(dist, row[0], path, row)
        problem = _check_entry(entry, inside, to_hash, hash_linked=hash_linked)
        if problem is None:
            continue
        if problem.endswith(_DIFFERS_IN_SIZE):
            problem = problem[: -len(_DIFFERS_IN_SIZE)]
            if entry.digest:
                differing.append((entry, problem))
                continue
        problems.append(problem)
    return problems, to_hash, differing


# RECORD rows that their own wheel contradicts, by (dist-info, path, RECORD's sha256) -> the
# (size, sha256) the wheel holds. pynvvideocodec 2.0.4 (every platform's wheel) records two
# extension modules 36,191 (x86_64) or 64,895 (aarch64) bytes smaller than it ships, with the
# digests of those smaller files: measured from the wheels of the vLLM stack's lock, each
# unpacked by uv with its sha256 checked against the lock.
RECORD_ERRATA: dict[tuple[str, str, str], tuple[int, str]] = {
    ("pynvvideocodec-2.0.4.dist-info", f"PyNvVideoCodec/PyNvVideoCodec_{cu}.cpython-312-{arch}-linux-gnu.so", recorded): (size, real)
    for cu, arch, recorded, size, real in (
        ("121", "x86_64", "xHGpsXTzQ7UrIn9fMPOPHQ6LDpkChEOndoAOlWlVpJU", 2443232, "L7hfi80zwT4kDvKoxid_TVoCYLYp7PmiQqBPFAP1gqg"),
        ("130", "x86_64", "IjqUR4p79WBAgGu86xwJfQFEo88rgPrpl4hdb06yuMI", 2459616, "FPEqeXfC9oH7AWk-QUNDCL-1zw4sMe0sKdEXYzfIZGI"),
        ("121", "aarch64", "Lg7BDY4BWJcoMoq8TM2aHA99TSnX8MP2kvMExk0r14g", 2459328, "Ft23oVGQQcsNLNWVAsIgMvixDkIdFu7VHl_-YxZD7LQ"),
        ("130", "aarch64", "7mB1bLWH3R6TFpOgANniy7fWO9RHawq_nbLwID4nxwY", 2524864, "9-yZLePHJX9Ef6k2v9OG1ZeeFDbl18AOeoswgSR09Rg"),
        ("121", "aarch64", "s4QYLAFMTKzkaQ15Us8g63MV8n-0n-t0PHArvBfyOcA", 2388280, "kJM4XkkRAdqs_mluneEUUfmBT1ujkQHXsAATbGlTgGA"),
        ("130", "aarch64", "QiTqVTgrxn4Ac9nFvF8Niv6tXCjtrqk_5d2nI6oqGKc", 2388280, "Yh5eZZEMC-wbGWDUmw044C_nOlEXBwMbhg6YfrCIfjU"),
    )
}  # fmt: skip

# How _check_entry marks a file whose size differs from its RECORD (cut before it is said):
# such a file may be a wheel's own (an erratum above), which its hash decides.
_DIFFERS_IN_SIZE = "\0size"


def _as_erratum(entry: _Recorded, errata: Mapping[tuple[str, str, str], tuple[int, str]]) -> bool:
    """Whether ``entry``'s file is what its wheel really ships where RECORD is known wrong."""
    known = errata.get((entry.dist, entry.rel, entry.digest or ""))
    if known is None or entry.algorithm != "sha256":
        return False
    try:
        return (
            os.lstat(entry.path).st_size == known[0] and _digest(entry.path, "sha256") == known[1]
        )
    except OSError:
        return False


def _unlisted(site: Path, tops: set[str], known: set[str]) -> list[str]:
    """The entries of ``site`` itself that no RECORD names and the install did not find there."""
    try:
        names = sorted(p.name for p in site.iterdir())
    except OSError as exc:
        return [f"{site}: {exc.strerror}"]
    found = []
    for name in names:
        if name in tops or name in known or name == "__pycache__":
            continue
        why = " (a .pth file runs at every interpreter start)" if name.endswith(".pth") else ""
        found.append(
            f"{name}: in site-packages, but no installed distribution's RECORD lists it{why}"
        )
    return found


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


def same_version(installed: str, locked: str) -> bool:
    try:
        return Version(installed) == Version(locked)
    except InvalidVersion:
        return installed == locked


def _entry(dist: str, rel: str, path: str, row: list[str]) -> _Recorded:
    algorithm = digest = None
    if len(row) > 1 and "=" in row[1]:
        algorithm, _, digest = row[1].partition("=")
    size = int(row[2]) if len(row) > 2 and row[2].strip().isdigit() else None
    return _Recorded(dist=dist, rel=rel, path=path, algorithm=algorithm, digest=digest,
                     size=size)  # fmt: skip


def _check_entry(
    entry: _Recorded, inside: str, to_hash: list[_Recorded], *, hash_linked: bool
) -> str | None:
    """None if the file is as RECORD says (its hash left to :func:`_hash_problems`, queued in
    ``to_hash``), else the problem; ``inside``: the env's path and a separator. A size that
    differs ends in :data:`_DIFFERS_IN_SIZE`."""
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
        said = f"{entry.dist}: {entry.rel}: {st.st_size} bytes, RECORD says {entry.size}"
        if st.st_nlink > 1:
            # One inode with uv's cache: the cache's copy is the damaged one.
            name = entry.dist.partition("-")[0]
            said += f"; uv's cache holds this copy (`uv cache clean {name}`, then build again)"
        return said + _DIFFERS_IN_SIZE
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


def prove(
    site: Path,
    root: Path,
    name: str,
    packages: Sequence[LockedPackage],
    marker_env: dict[str, str],
    made_before: Sequence[str] = (),
    *,
    apart: Sequence[str] = (),
    only: Sequence[str] | None = None,
) -> None:
    """BuildError (naming the env ``name`` being built at ``root``) unless every locked package
    whose marker holds in ``marker_env`` (the others uv rightly skips) is installed and every
    file its RECORD names is there as recorded: uv can exit 0 over packages a failed earlier
    run left half-copied (a full disk), and the env must not replace a working one then.
    ``made_before``, ``apart`` and ``only`` as :func:`problems`'s."""
    found = problems(
        site,
        root,
        [p for p in packages if applies(p, marker_env)],
        made_before=made_before,
        apart=apart,
        only=only,
    )
    if not found:
        return
    free = shutil.disk_usage(root.parent).free // 2**20
    shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
    raise BuildError(
        f"{name}: the install is incomplete: {len(found)} file(s) or package(s) "
        f"are not as their RECORD says ({shown}); {free} MiB free in {root.parent}. Nothing "
        "was replaced: the previous env, if any, is intact"
    )


class Proof:
    """The build's proof of its install (:func:`prove`), made once where it can be.

    Where the lock has packages that compile at install, the lock's own proof waits until
    something is about to run in the env (a compile: the sdist's ``setup.py`` imports torch),
    so that an env whose every such package comes from the store is proven by one read of
    all its RECORDs, not one before and one after (each read is an ``lstat`` of every file
    the RECORDs name: ~0.1 s for a torch env, the largest cost of a second env taking its
    wheels from the store). A wheel taken from the store is installed while the lock's wheels
    are proven (builder/env/sourcebuild.py), where it only adds entries of its own to
    site-packages: its proof then reads its own RECORD alone."""

    def __init__(
        self,
        site: Path,
        root: Path,
        name: str,
        marker_env: dict[str, str],
        made_before: Sequence[str],
        packages: Sequence[LockedPackage],
        stage: Callable[[str, float], None],
    ) -> None:
        self.site, self.root, self.name, self.marker_env = site, root, name, marker_env
        self.made_before = list(made_before)  # entries of site no RECORD lists: the venv's
        self.packages = list(packages)  # the lock's, installed by uv
        self.stage = stage
        self.proven = False

    def lock(self, started: float | None = None, *, apart: Sequence[str] = ()) -> None:
        """Prove the lock's wheels now: before anything runs in the env. Then the site's
        entries so far (the lock's and cudaenv's own hook files) are known to the proof of
        what compiles. ``apart``: entries of site-packages an install running meanwhile
        writes, which neither this proof nor the known entries count."""
        if self.proven:
            return
        t = time.monotonic() if started is None else started
        prove(self.site, self.root, self.name, self.packages, self.marker_env,
              self.made_before, apart=apart)  # fmt: skip
        self.made_before = sorted({p.name for p in self.site.iterdir()} - set(apart))
        self.proven = True
        self.stage(f"every file of {len(self.packages)} packages' RECORD in place", t)

    def beside_install(self, arriving: Sequence[str]) -> None:
        """A wheel from the store is installing meanwhile, adding ``arriving``: its own proof
        is :meth:`rest`'s."""
        self.lock(apart=arriving)

    def rest(self, compiled: Sequence[LockedPackage], apart: Sequence[Sequence[str]]) -> None:
        """Prove ``compiled`` (installed since; ``apart``: the entries each added beside the
        lock's proof, none for one installed alone or compiled): with the lock's packages
        where those were not proven yet; by their own RECORDs alone where each was installed
        beside the lock's proof; else with every RECORD again (a compile ran in the env)."""
        if not self.proven:
            self.packages += compiled
            self.lock()
            return
        only = [top for tops in apart for top in tops] if all(apart) else None
        prove(self.site, self.root, self.name, compiled, self.marker_env, self.made_before,
              only=only)  # fmt: skip
