"""Read and write PEP 751 ``pylock.NAME.toml`` files with the spec fingerprint they came from.

Every file entry names its wheel/sdist file, size and sha256, and where a PEP 751 reader gets
it: its ``url`` (the default), or, in an index-neutral project (project.py), a ``path`` in the
wheelhouse beside the lock. ``cudaenv build`` uses neither: it installs name==version with
every hash through uv's index configuration on the machine that builds, and the hashes make
any index (a mirror, a proxy, a wheelhouse) give exactly these files.

Locks are read with ``packaging.pylock``, the reference PEP 751 validator, so a lock cudaenv
accepts is one uv and pip accept too.

A lock is an input file like the spec, and one a pull request can edit where a reviewer reads
only the spec: what it says about where files come from is believed only as far as the spec
says the same (:func:`read`). An entry may name an index, and so be installed from its file
URL, only where the spec's ``indexes:`` pins that package to that index, with every URL of
the entry on it; every other URL of a lock is never fetched (build and export ask the
machine's index for name, version and hash). A file ``path`` names a file beside the lock:
relative, normalised, ending in the file's own name (export.py holds it to the project's
wheelhouse).

What a lock holds once read (:class:`Lock`, its entries and files) is
:mod:`builder.spec.lockmodel`'s.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import os
import posixpath
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packaging.utils import canonicalize_name

from builder.core import indexview
from builder.core import platforms as platforms_mod
from builder.core.errors import BuildError, LockUnreadable, ReportError, ResolveError, SpecError
from builder.core.paths import cache_dir
from builder.core.proc import atomic_write_text
from builder.formats import codec, tomlwriter
from builder.formats.yamldoc import Unreadable, read_input

# The model lives below this module; it is named here too, where every caller reads it.
from builder.spec.lockmodel import Lock as Lock
from builder.spec.lockmodel import LockedFile as LockedFile
from builder.spec.lockmodel import LockedPackage as LockedPackage
from builder.spec.lockmodel import served_by as served_by

if TYPE_CHECKING:
    from packaging.pylock import PackageSdist, PackageWheel

    from builder.spec.envspec import EnvSpec

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# The largest committed lock (two platforms of the sglang stack, ~500 files) is ~160 KB: 100
# times that still reads in well under a second, and /dev/zero or a runaway file stops here.
MAX_LOCK_BYTES = 16 * 1024 * 1024
# The parse memo (:func:`_read`): v3 carries the sha256 of the lock text it was parsed from.
MEMO_VERSION = 5  # v5: a negative file size refused (a memo of v4 was validated without it)


def _file(entry: PackageWheel | PackageSdist, where: str) -> LockedFile:
    sha256 = entry.hashes.get("sha256")
    if not isinstance(sha256, str):
        raise ResolveError(f"{where}: a file without a sha256 hash cannot be installed safely")
    if entry.size is not None and entry.size < 0:
        raise ResolveError(f"{where}.size: a file's size is a number of bytes, got {entry.size}")
    return LockedFile(
        name=entry.filename,
        sha256=sha256,
        size=entry.size,
        upload_time=entry.upload_time.isoformat() if entry.upload_time else None,
        url=entry.url,
        path=entry.path,
    )


def parse_packages(doc: dict[str, Any], where: str) -> tuple[LockedPackage, ...]:
    """The ``[[packages]]`` of a PEP 751 document (ours or uv's), validated by
    ``packaging.pylock`` and then held to cudaenv's own rules: an exact version and a sha256
    for every file (builds install with ``--require-hashes``)."""
    # Imported here: only a lock not yet in the memo (or uv's output) is validated.
    from packaging.pylock import Pylock, PylockValidationError

    try:
        pylock = Pylock.from_dict(doc)
    except PylockValidationError as exc:
        context = exc.context or ""
        if context.endswith(".hashes"):
            # Say why a hash matters here, at the same key path packaging names.
            raise ResolveError(
                f"{where}: {context.removesuffix('.hashes')}: a file without a sha256 hash "
                "cannot be installed safely"
            ) from exc
        raise ResolveError(f"{where}: not a valid PEP 751 lock: {exc}") from exc
    out = []
    # packaging has checked that doc["packages"] is a list of tables, one per entry. The
    # marker is kept as its writer spelled it (packaging's str() re-quotes it), so a re-lock
    # leaves unchanged markers unchanged.
    for i, (entry, raw) in enumerate(zip(pylock.packages, doc["packages"], strict=True)):
        here = f"{where}: packages[{i}]"
        if entry.version is None:
            raise ResolveError(f"{here} ({entry.name}): a package needs an exact version")
        if entry.is_direct:
            raise ResolveError(f"{here} ({entry.name}): no wheel or sdist to install")
        wheels = tuple(_file(w, f"{here}.wheels[{j}]") for j, w in enumerate(entry.wheels or ()))
        ours = (entry.tool or {}).get("cudaenv")
        on = ours.get("platforms") if isinstance(ours, dict) else None
        if on is not None and (
            not isinstance(on, list) or not on or not all(isinstance(x, str) for x in on)
        ):
            raise ResolveError(
                f"{here} ({entry.name}): tool.cudaenv.platforms: expected a list of platform names"
            )
        out.append(
            LockedPackage(
                name=entry.name,
                version=str(entry.version),
                marker=raw["marker"] if entry.marker is not None else None,
                wheels=wheels,
                sdist=_file(entry.sdist, f"{here}.sdist") if entry.sdist else None,
                index=entry.index,
                platforms=tuple(on or ()),
            )
        )
    # Two entries of one name (a version per platform) keep their platforms' order.
    return tuple(sorted(out, key=lambda p: p.name))


def _file_inline(f: LockedFile) -> str:
    if not f.url and not f.path:
        # PEP 751: a reader must be told where the file is (resolve.pin_sources sets one).
        raise ValueError(f"{f.name}: a locked file needs a url or a path")
    items: list[tuple[str, object]] = [("name", f.name)]
    if f.url:
        items.append(("url", f.url))
    if f.path:
        items.append(("path", f.path))
    if f.upload_time:
        try:
            items.append(("upload-time", dt.datetime.fromisoformat(f.upload_time)))
        except ValueError:
            items.append(("upload-time", f.upload_time))
    if f.size is not None:
        items.append(("size", f.size))
    items.append(("hashes", {"sha256": f.sha256}))
    return tomlwriter.inline_table(items)


# The PEP 751 version every lock cudaenv writes declares (a fixed line: nothing to escape).
LOCK_VERSION_LINE = 'lock-version = "1.0"'


def dumps(lock: Lock) -> str:
    """PEP 751 text, laid out here (one inline table per file, as uv writes them) with every
    value written by builder/formats/tomlwriter.py: the schema is fixed and small, and a generic TOML
    document writer was a third of a re-lock's overhead."""
    wheelhouse = lock.wheelhouse
    if wheelhouse is not None:
        about = [
            "# PEP 751 lock, index-neutral: each file is named and hash-pinned at a path in",
            f"# {wheelhouse}/ beside this lock, which `cudaenv export SPEC` fills from the",
            "# machine's index; only a package the spec pins to an index keeps its URL.",
            "# `cudaenv build` needs no wheelhouse: it installs these names, versions and hashes",
            "# through the index uv is configured with.",
        ]
    else:
        about = [
            "# PEP 751 lock: every file with its URL and hash. `cudaenv build` installs the same",
            "# names, versions and hashes through the index uv is configured with.",
        ]
    pair = tomlwriter.pair
    out = [
        f"# This file was generated by `{lock.command or 'cudaenv lock'}`; do not edit.",
        *about,
        LOCK_VERSION_LINE,
        *tomlwriter.array_lines(
            "environments", [platforms_mod.get(p).marker for p in lock.platforms]
        ),
        pair("requires-python", f"=={lock.python}.*"),
        pair("created-by", "cudaenv"),
    ]
    if not lock.packages:
        # PEP 751 requires the key: a lock of nothing says so (packaging.pylock refuses none).
        out.append(pair("packages", ()))
    for pkg in lock.packages:
        out += ["", "[[packages]]", pair("name", pkg.name), pair("version", pkg.version)]
        if pkg.marker:
            out.append(pair("marker", pkg.marker))
        if pkg.index:
            out.append(pair("index", pkg.index))
        if pkg.sdist:
            out.append(f"sdist = {_file_inline(pkg.sdist)}")
        if pkg.wheels:
            out.append("wheels = [")
            out += [f"    {_file_inline(w)}," for w in pkg.wheels]
            out.append("]")
        if pkg.platforms:
            out += ["[packages.tool.cudaenv]", pair("platforms", pkg.platforms)]
    out += ["", "[tool.cudaenv]"]
    fields = (
        ("spec", lock.spec_name),
        ("fingerprint", lock.fingerprint),
        ("python", lock.python),
        ("cuda", lock.cuda),
        ("torch", lock.torch),
        ("torch-cuda", lock.torch_cuda),
        ("toolkit", lock.toolkit),
    )
    out += [pair(key, value) for key, value in fields if value is not None]
    out.append(pair("platforms", lock.platforms))
    if lock.exclude_newer is not None:
        out.append(pair("exclude-newer", lock.exclude_newer))
    if lock.exclude_newer_packages:
        out.append(pair("exclude-newer-package", dict(lock.exclude_newer_packages)))
    out.append(pair("notes", lock.notes))
    return "\n".join(out) + "\n"


def packages_to_json(packages: Iterable[LockedPackage]) -> list[dict[str, Any]]:
    return [codec.to_json(p) for p in packages]


def packages_from_json(items: list[Any]) -> tuple[LockedPackage, ...]:
    """What :func:`packages_to_json` wrote; ValueError naming the entry and key otherwise."""
    try:
        return tuple(
            codec.from_json(LockedPackage, item, f"packages[{i}]", "memo")
            for i, item in enumerate(items)
        )
    except ReportError as exc:
        raise ValueError(str(exc)) from exc


def write(lock: Lock, path: Path) -> None:
    """Atomically, so an interrupted lock never leaves half a file; and only a lock every PEP
    751 reader takes: the text is read back with tomllib and validated by packaging.pylock
    and by :func:`read`'s own rules first (ResolveError naming the key otherwise, and nothing
    written). That parse is the memo :func:`read` then finds, so the lock just written is not
    parsed again; a text validated before (its memo is there) is not validated again."""
    text = dumps(lock)
    raw = text.encode()
    digest = hashlib.sha256(raw).hexdigest()
    memo = _memo_path(digest)
    if _memo_lock(memo, digest) is None:
        try:
            parsed = _lock_of(tomllib.loads(text), str(path))
        except tomllib.TOMLDecodeError as exc:  # a writer's bug: never a file a reader refuses
            raise ResolveError(f"{path}: the lock's text is not TOML ({exc}); not written") from exc
        except ResolveError as exc:
            raise ResolveError(f"{exc}; the lock was not written") from exc
        _remember(memo, parsed, digest)
    atomic_write_text(path, text)


def lock_path(spec_source: Path, name: str) -> Path:
    """Where the lock of the spec ``name`` read from ``spec_source`` lives: ``locks/`` beside
    the spec file, as ``pylock.<name>.toml`` with every dot of the name turned into '-'.

    PEP 751 allows no dot in that name (uv refuses ``pylock.sglang-0.5.23-cu130.toml``; so
    does ``packaging.pylock.is_valid_pylock_path``); a spec name may have them. The lock keeps
    the spec's own name (``[tool.cudaenv] spec``), so two names folding to one file (``a.b``,
    ``a-b``) are told apart on read (:func:`read`). The only place lock paths are made.
    """
    return spec_source.parent / "locks" / f"pylock.{name.replace('.', '-')}.toml"


def read(path: Path, *, spec: EnvSpec | None = None, spec_name: str | None = None) -> Lock:
    """The lock at ``path``; with ``spec`` (or only its ``spec_name``), refused unless that
    spec wrote it. Every entry that names an index, or a file path, is held to the spec (see
    the module's docstring): without ``spec``, no entry may name an index. Raises SpecError
    (exit 2, a bad input file) with every such entry, LockUnreadable (a SpecError) for a lock
    that does not parse (re-lock it), BuildError for one that is not there."""
    lk = _read(path)
    if spec is not None or spec_name is not None:
        check_owner(lk, path, spec.name if spec is not None else str(spec_name))
    problems = source_problems(lk, path, dict(spec.indexes) if spec is not None else {})
    if problems:
        raise SpecError(problems, "lock")
    return lk


def source_problems(lk: Lock, path: Path, pins: dict[str, str]) -> list[str]:
    """Where ``lk`` (read from ``path``) says files come from, held to ``pins`` (the spec's
    ``indexes:``, package -> index URL): one problem per entry and key."""
    where = str(path)
    problems = []
    for pkg in lk.packages:
        here = f"{where}: {pkg.name}=={pkg.version}"
        pin = pins.get(canonicalize_name(pkg.name))
        if pkg.index is not None and pin is None:
            problems.append(
                f"{here}: index: {pkg.index!r} is named, but the spec pins no index for "
                f"{pkg.name}; refusing a lock that says where to fetch a package from on its "
                "own (re-lock it with `cudaenv lock`, or pin it in the spec's `indexes:`)"
            )
            continue
        if pin is not None and (pkg.index is None or pkg.index.rstrip("/") != pin):
            problems.append(
                f"{here}: index: {pkg.index!r} is not {pin!r}, the index the spec pins "
                f"{pkg.name} to; re-lock it with `cudaenv lock`"
            )
            continue
        for f in pkg.files:
            if pin is not None and f.url is not None and not served_by(f.url, pin):
                problems.append(
                    f"{here}: url: {f.url!r} is not a file of {pin!r}, the index the spec "
                    f"pins {pkg.name} to; re-lock it with `cudaenv lock`"
                )
            if f.path is not None and not _plain_path(f.path, f.name):
                problems.append(
                    f"{here}: path: {f.path!r} is not a relative path to {f.name!r} beside "
                    "the lock; re-lock it with `cudaenv lock`"
                )
    return problems


def _plain_path(path: str, name: str) -> bool:
    """What resolve.pin_sources writes: ``<wheelhouse>/<file name>``, relative, normalised."""
    return (
        not path.startswith("/")
        and "\\" not in path
        and "\x00" not in path
        and posixpath.normpath(path) == path
        and posixpath.basename(path) == name
        and name not in ("", ".", "..")
    )


def check_owner(lk: Lock, path: Path, spec_name: str) -> None:
    """Refuse the lock of another spec whose name maps to the same file (:func:`lock_path`)."""
    check_owner_name(lk.spec_name, path, spec_name)


def check_owner_name(owner: str, path: Path, spec_name: str) -> None:
    if owner != spec_name:
        raise BuildError(
            f"{path} is the lock of spec '{owner}', not of '{spec_name}': both names map "
            f"to {path.name} (dots become '-'); rename one of the specs"
        )


def owner(path: Path) -> str | None:
    """The spec name in the lock's ``[tool.cudaenv]``, reading only that table (we write it
    last); None when there is no readable lock. For the check before a re-lock, which must
    not pay for parsing every package."""
    try:
        text = read_input(path, MAX_LOCK_BYTES, "lock").decode()
    except (Unreadable, UnicodeDecodeError):  # a FIFO there must not hang `cudaenv lock`
        return None
    start = text.rfind("\n[tool.cudaenv]\n")
    try:
        table = tomllib.loads(text[start:] if start >= 0 else text)
    except tomllib.TOMLDecodeError:
        return None
    tool = table.get("tool", {}).get("cudaenv") if isinstance(table.get("tool"), dict) else None
    spec = tool.get("spec") if isinstance(tool, dict) else None
    return spec if isinstance(spec, str) else None


def _read(path: Path) -> Lock:
    """Parsed once per content: the memo (JSON, named by the file's sha256) makes reading the
    largest committed lock ~3 ms instead of ~40 ms of TOML and validation (plus ~70 ms to
    import packaging.pylock) on every build, plan and list. The memo is believed instead of
    the lock, so it is read only where it cannot say something else (:func:`_memo_lock`);
    :func:`read` holds a memo's lock to the spec as it holds a parsed one."""
    try:
        path.stat()
    except OSError as exc:
        raise BuildError(
            f"{path}: cannot read the lock ({exc.strerror}); run `cudaenv lock`"
        ) from exc
    try:
        raw = read_input(path, MAX_LOCK_BYTES, "lock")
    except Unreadable as exc:
        raise SpecError([f"{path}: {exc}"], "lock") from exc
    digest = hashlib.sha256(raw).hexdigest()
    memo = _memo_path(digest)
    found = _memo_lock(memo, digest)
    if found is not None:
        return found
    lk = _parse(path, raw)
    _remember(memo, lk, digest)
    return lk


def _memo_path(digest: str) -> Path:
    return cache_dir() / "locks" / f"{digest}.v{MEMO_VERSION}.json"


def _remember(memo: Path, lk: Lock, digest: str) -> None:
    with contextlib.suppress(OSError):  # only a cache
        atomic_write_text(memo, json.dumps(_to_memo(lk, digest)))
        # atomic_write_text leaves what the umask allows (0664 under umask 002): a memo is
        # read back only when no one else can write it.
        memo.chmod(0o644)


def _memo_lock(memo: Path, digest: str) -> Lock | None:
    """The lock the memo at ``memo`` holds, when it is one this user wrote of the lock text
    whose sha256 is ``digest``; None otherwise (then the lock is parsed).

    Owned by this user and writable by no one else: in a shared or world-writable cache
    directory (``CUDAENV_CACHE_DIR``) another user's file would decide what gets installed.
    The sha256 inside: a file renamed onto this name (a memo of another lock) is no answer.
    No link is followed and a FIFO never blocks (O_NOFOLLOW, O_NONBLOCK)."""
    try:
        fd = os.open(memo, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_uid != os.geteuid()
            or st.st_mode & 0o022
            or st.st_size > 4 * MAX_LOCK_BYTES
        ):
            return None
        with os.fdopen(os.dup(fd), "rb") as fh:
            doc = json.loads(fh.read())
        if not isinstance(doc, dict) or doc.get("lock_sha256") != digest:
            return None
        return _from_memo(doc["lock"])
    except (OSError, ValueError, TypeError, KeyError, ReportError):
        return None
    finally:
        os.close(fd)


def _to_memo(lk: Lock, digest: str) -> dict[str, Any]:
    return {"lock_sha256": digest, "lock": codec.to_json(lk)}


def _from_memo(doc: object) -> Lock:
    return codec.from_json(Lock, doc, "lock memo")


def _parse(path: Path, raw: bytes) -> Lock:
    """The lock in ``raw``; a file that is no valid lock is bad input (LockUnreadable, exit 2,
    as the exit codes document for a lock), one line naming the file and what is wrong."""
    try:
        doc = tomllib.loads(raw.decode())
    except UnicodeDecodeError as exc:
        raise LockUnreadable(
            f"{path}: the lock is not UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "run `cudaenv lock`"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise LockUnreadable(f"{path}: not a valid TOML lock: {exc}; run `cudaenv lock`") from None
    except RecursionError:
        raise LockUnreadable(
            f"{path}: not a lock: nested deeper than the TOML reader goes; run `cudaenv lock`"
        ) from None
    try:
        return _lock_of(doc, str(path))
    except ResolveError as exc:
        raise LockUnreadable(f"{exc}; run `cudaenv lock`") from None


def _lock_of(doc: dict[str, Any], where: str) -> Lock:
    """The lock of the TOML document ``doc``, validated by packaging.pylock and held to
    cudaenv's rules (:func:`parse_packages`, the ``[tool.cudaenv]`` table); ResolveError."""
    tool = doc.get("tool", {}).get("cudaenv") if isinstance(doc.get("tool"), dict) else None
    if not isinstance(tool, dict):
        raise ResolveError(f"{where}: not a cudaenv lock (no [tool.cudaenv])")
    packages = parse_packages(doc, where)

    def opt(key: str) -> str | None:
        value = tool.get(key)
        return str(value) if value is not None else None

    for key in ("spec", "fingerprint", "python", "cuda"):
        if not isinstance(tool.get(key), str):
            raise ResolveError(f"{where}: [tool.cudaenv] lacks '{key}'")
    notes = tool.get("notes", [])
    on = tool.get("platforms")
    if on is None and isinstance(tool.get("platform"), str):
        on = [platforms_mod.from_uv_tag(tool["platform"])]  # written before `platforms:`
    if not isinstance(on, list) or not on or not all(isinstance(p, str) for p in on):
        raise ResolveError(f"{where}: [tool.cudaenv] lacks 'platforms'")
    view, per_package = _view_of(tool, where)
    return Lock(
        spec_name=tool["spec"],
        fingerprint=tool["fingerprint"],
        python=tool["python"],
        platforms=tuple(on),
        cuda=tool["cuda"],
        torch=opt("torch"),
        torch_cuda=opt("torch-cuda"),
        toolkit=opt("toolkit"),
        packages=packages,
        notes=tuple(str(n) for n in notes) if isinstance(notes, list) else (),
        exclude_newer=view,
        exclude_newer_packages=per_package,
    )


def _view_of(tool: dict[str, Any], where: str) -> tuple[str | None, tuple[tuple[str, str], ...]]:
    """``exclude-newer`` and ``exclude-newer-package`` of ``[tool.cudaenv]``, each time held to
    what indexview.parse takes (a lock's text goes to uv's command line)."""

    def moment(value: object, key: str) -> str:
        if not isinstance(value, str) or indexview.problem(value) is not None:
            raise ResolveError(f"{where}: [tool.cudaenv] {key}: expected {indexview.SPELLINGS}")
        return indexview.canonical(value)

    raw = tool.get("exclude-newer")
    at = None if raw is None else moment(raw, "exclude-newer")
    table = tool.get("exclude-newer-package", {})
    if not isinstance(table, dict):
        raise ResolveError(f"{where}: [tool.cudaenv] exclude-newer-package: expected a table")
    per_package = []
    for name, value in sorted(table.items()):
        if canonicalize_name(name) != name:
            raise ResolveError(
                f"{where}: [tool.cudaenv] exclude-newer-package.{name}: not a normalised name"
            )
        per_package.append((name, moment(value, f"exclude-newer-package.{name}")))
    return at, tuple(per_package)
