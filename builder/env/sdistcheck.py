"""What an sdist says before anything is installed: each package of a lock that compiles at
install (only an sdist on one of its platforms) is fetched by the lock's own URL or path, its
sha256 checked against the lock, and its ``setup.py`` read, never run, for what the env cannot
give (recipes.before_compiling: a C++ standard torch's headers refuse, an arch the toolkit
dropped, a source file the sdist lacks). ``lock``, ``plan`` and ``build`` say it before uv
installs a package, where the build would otherwise find it after installing the whole lock.

What is read of each sdist (its setup.py text and its file names) is kept in cudaenv's cache
under the sdist's sha256 (core/cachefiles.py rules), so a second look costs no download. An
sdist that cannot be fetched (offline, an index that needs credentials) is not judged here;
the build judges it again before compiling.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from builder.core import cachefiles
from builder.core.errors import BuildError
from builder.env import recipes, setuppy, sourcebuild
from builder.spec.lockmodel import LockedFile, LockedPackage

# An sdist larger than this is not fetched to be read (flash-attn's is ~8 MB).
MAX_SDIST = 512 << 20
FETCH_TIMEOUT = 60.0  # each connect and read
FETCH_DEADLINE = 300.0  # the whole download: a server that trickles is not waited on forever
_CHUNK = 1 << 20
# Bump when what is kept of an sdist changes.
READ_VERSION = 1


def refuse(
    packages: Sequence[LockedPackage],
    *,
    torch: str | None,
    nvcc: str | None,
    lock_dir: Path,
    say: Callable[[str], None],
    done: str,
) -> None:
    """BuildError in one line where :func:`refusal` finds one; ``done`` says what was not done
    because of it ("the lock was not written", "nothing was installed"). The one way `lock`,
    `plan` and `build` refuse a release before installing it."""
    why = refusal(packages, torch=torch, nvcc=nvcc, lock_dir=lock_dir, say=say)
    if why is not None:
        raise BuildError(f"{why}; {done}")


def refusal(
    packages: Sequence[LockedPackage],
    *,
    torch: str | None,
    nvcc: str | None,
    lock_dir: Path,
    say: Callable[[str], None],
) -> str | None:
    """The first reason one of ``packages`` compiled at install (sourcebuild.source_packages)
    cannot build against
    torch ``torch`` and ``nvcc`` (the spec's CUDA), known from its sdist; None when none shows
    one. ``lock_dir``: where a lock's relative sdist paths start."""
    seen: set[tuple[str, str]] = set()
    for pkg in sourcebuild.source_packages(packages):
        if pkg.sdist is None or (pkg.name, pkg.version) in seen:
            continue  # one entry per platform of a lock: each sdist read once
        seen.add((pkg.name, pkg.version))
        read = _read(pkg.sdist, lock_dir, say, f"{pkg.name} {pkg.version}")
        if read is None:
            continue
        text, members = read
        why = recipes.before_compiling(
            pkg.name, pkg.version, text, torch, nvcc=nvcc, members=members
        )
        if why is not None:
            return why
    return None


def _read(
    sdist: LockedFile, lock_dir: Path, say: Callable[[str], None], what: str
) -> tuple[str, frozenset[str]] | None:
    """The sdist's setup.py text and file names: from the cache, else fetched and checked."""
    memo = _memo_path(sdist.sha256)
    if memo is not None:
        doc = cachefiles.read_json(memo)
        if (
            isinstance(doc, dict)
            and doc.get("version") == READ_VERSION
            and isinstance(doc.get("setup_py"), str)
            and isinstance(doc.get("members"), list)
            and all(isinstance(m, str) for m in doc["members"])
        ):
            return doc["setup_py"], frozenset(doc["members"])
    with tempfile.TemporaryDirectory(prefix="cudaenv-sdist-") as scratch:
        local = Path(scratch) / "sdist.tar.gz"
        problem = _fetch(sdist, lock_dir, local)
        if problem is not None:
            say(f"{what}: its sdist was not read before installing ({problem}); the build reads it")
            return None
        text, members = setuppy.from_sdist(local)
    if memo is not None:
        doc = {"version": READ_VERSION, "setup_py": text, "members": sorted(members)}
        cachefiles.write_json(memo, doc)
    return text, members


def _memo_path(sha256: str) -> Path | None:
    try:
        return cachefiles.cache_dir() / "sdists" / f"{sha256}.json"
    except OSError:
        return None


def _fetch(sdist: LockedFile, lock_dir: Path, dst: Path) -> str | None:
    """``sdist`` copied to ``dst`` with its sha256 checked; why not, else None."""
    if sdist.url:
        scheme = urllib.parse.urlsplit(sdist.url).scheme
        if scheme not in ("https", "http", "file"):
            return f"{scheme}: is not a URL cudaenv fetches"
        source = sdist.url
    elif sdist.path:
        source = (lock_dir / sdist.path).absolute().as_uri()  # a relative lock dir too
    else:
        return "the lock gives no URL or path"
    digest = hashlib.sha256()
    size = 0
    try:
        with (
            urllib.request.urlopen(source, timeout=FETCH_TIMEOUT) as answer,  # noqa: S310 - scheme checked
            dst.open("wb") as out,
        ):
            deadline = time.monotonic() + FETCH_DEADLINE
            while chunk := answer.read(_CHUNK):
                if time.monotonic() > deadline:
                    return f"not fetched within {FETCH_DEADLINE:.0f} s"
                size += len(chunk)
                if size > MAX_SDIST:
                    return f"larger than {MAX_SDIST >> 20} MiB"
                digest.update(chunk)
                out.write(chunk)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}"
    if digest.hexdigest() != sdist.sha256:
        with contextlib.suppress(OSError):
            dst.unlink()
        return "its sha256 is not the lock's"
    return None
