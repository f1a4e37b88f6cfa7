"""Read and write PEP 751 ``pylock.NAME.toml`` files with the spec fingerprint they came from.

Every file entry names its wheel/sdist file, size and sha256, and where a PEP 751 reader gets
it: its ``url`` (the default), or, in an index-neutral project (project.py), a ``path`` in the
wheelhouse beside the lock. ``cudaenv build`` uses neither: it installs name==version with
every hash through uv's index configuration on the machine that builds, and the hashes make
any index (a mirror, a proxy, a wheelhouse) give exactly these files.

Locks are read with ``packaging.pylock``, the reference PEP 751 validator, so a lock cudaenv
accepts is one uv and pip accept too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import posixpath
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from builder import platforms as platforms_mod
from builder.errors import BuildError, ResolveError
from builder.paths import cache_dir
from builder.proc import atomic_write_text

if TYPE_CHECKING:
    from packaging.pylock import PackageSdist, PackageWheel

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


@dataclass(frozen=True, kw_only=True)
class LockedFile:
    name: str  # the wheel or sdist file name
    sha256: str
    size: int | None = None
    upload_time: str | None = None
    # Where a PEP 751 reader gets the file (every entry has one or both): the exact file on an
    # index, or a path relative to the lock file's directory (an index-neutral lock).
    url: str | None = None
    path: str | None = None


@dataclass(frozen=True, kw_only=True)
class LockedPackage:
    name: str
    version: str
    marker: str | None = None
    wheels: tuple[LockedFile, ...] = ()
    sdist: LockedFile | None = None
    index: str | None = None  # the index the spec pins this package to
    # The lock's platforms this entry installs on; () = all of them. Written as
    # [packages.tool.cudaenv] (PEP 751's per-package tool table), with the marker saying the
    # same for other installers.
    platforms: tuple[str, ...] = ()

    def on(self, platform: str) -> bool:
        return not self.platforms or platform in self.platforms

    @property
    def files(self) -> tuple[LockedFile, ...]:
        return (*self.wheels, *((self.sdist,) if self.sdist else ()))

    @property
    def hashes(self) -> tuple[str, ...]:
        return tuple(f.sha256 for f in self.files)


@dataclass(frozen=True, kw_only=True)
class Lock:
    spec_name: str
    fingerprint: str
    python: str
    platforms: tuple[str, ...]  # platform names (platforms.py), in the spec's order
    cuda: str
    torch: str | None
    torch_cuda: str | None
    toolkit: str | None  # the cuda-toolkit version every component is pinned to
    packages: tuple[LockedPackage, ...]
    command: str = ""
    notes: tuple[str, ...] = ()

    def packages_on(self, platform: str) -> tuple[LockedPackage, ...]:
        """What installs on ``platform`` (one of :attr:`platforms`)."""
        return tuple(p for p in self.packages if p.on(platform))

    def requirements_txt(self, platform: str) -> str:
        """``name==version --hash=...`` lines for ``uv pip sync --require-hashes``: the
        entries of ``platform`` only, so an installer never weighs the other's versions."""
        lines = []
        for pkg in self.packages_on(platform):
            marker = f" ; {pkg.marker}" if pkg.marker else ""
            hashes = " ".join(f"--hash=sha256:{h}" for h in pkg.hashes)
            pinned = next((f.url for f in pkg.wheels if f.url), None)
            if pkg.index and pinned:
                # The exact file of the pinned index: no other index is asked for it.
                lines.append(f"{pkg.name} @ {pinned}{marker} {hashes}")
            else:
                lines.append(f"{pkg.name}=={pkg.version}{marker} {hashes}")
        return "\n".join(lines) + "\n"

    @property
    def wheelhouse(self) -> str | None:
        """The directory (relative to the lock file's) an index-neutral lock's file paths name;
        None for a lock whose files carry URLs. Raises BuildError when the paths name more than
        one (cudaenv never writes that)."""
        dirs = {posixpath.dirname(f.path) or "." for p in self.packages for f in p.files if f.path}
        if len(dirs) > 1:
            raise BuildError(
                f"the lock of {self.spec_name} names files in {len(dirs)} directories "
                f"({', '.join(sorted(dirs))}); re-lock it with `cudaenv lock`"
            )
        return dirs.pop() if dirs else None

    def content_hash(self) -> str:
        """Identifies exactly what gets installed (names, versions, file hashes)."""
        h = hashlib.sha256()
        for pkg in self.packages:
            h.update(f"{pkg.name}=={pkg.version};{','.join(sorted(pkg.hashes))}\n".encode())
        return "sha256:" + h.hexdigest()


def _file(entry: PackageWheel | PackageSdist, where: str) -> LockedFile:
    sha256 = entry.hashes.get("sha256")
    if not isinstance(sha256, str):
        raise ResolveError(f"{where}: a file without a sha256 hash cannot be installed safely")
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


def _s(value: str) -> str:
    """A TOML basic string: JSON's string escapes are all valid TOML escapes."""
    return json.dumps(value, ensure_ascii=False)


def _file_inline(f: LockedFile) -> str:
    if not f.url and not f.path:
        # PEP 751: a reader must be told where the file is (resolve.pin_sources sets one).
        raise ValueError(f"{f.name}: a locked file needs a url or a path")
    parts = [f"name = {_s(f.name)}"]
    if f.url:
        parts.append(f"url = {_s(f.url)}")
    if f.path:
        parts.append(f"path = {_s(f.path)}")
    if f.upload_time:
        try:
            stamp = dt.datetime.fromisoformat(f.upload_time)
            parts.append(f"upload-time = {stamp.isoformat()}")
        except ValueError:
            parts.append(f"upload-time = {_s(f.upload_time)}")
    if f.size is not None:
        parts.append(f"size = {f.size}")
    parts.append(f"hashes = {{ sha256 = {_s(f.sha256)} }}")
    return "{ " + ", ".join(parts) + " }"


def dumps(lock: Lock) -> str:
    """PEP 751 text, written directly (one inline table per file, as uv writes them): the
    schema is fixed and small, and a generic TOML writer was a third of a re-lock's overhead."""
    if lock.wheelhouse is not None:
        about = [
            "# PEP 751 lock, index-neutral: each file is named and hash-pinned at a path in",
            f"# {lock.wheelhouse}/ beside this lock, which `cudaenv export SPEC` fills from the",
            "# machine's index; only a package the spec pins to an index keeps its URL.",
            "# `cudaenv build` needs no wheelhouse: it installs these names, versions and hashes",
            "# through the index uv is configured with.",
        ]
    else:
        about = [
            "# PEP 751 lock: every file with its URL and hash. `cudaenv build` installs the same",
            "# names, versions and hashes through the index uv is configured with.",
        ]
    out = [
        f"# This file was generated by `{lock.command or 'cudaenv lock'}`; do not edit.",
        *about,
        'lock-version = "1.0"',
        "environments = [",
        *(f"    {_s(platforms_mod.get(p).marker)}," for p in lock.platforms),
        "]",
        f"requires-python = {_s(f'=={lock.python}.*')}",
        'created-by = "cudaenv"',
    ]
    for pkg in lock.packages:
        out += ["", "[[packages]]", f"name = {_s(pkg.name)}", f"version = {_s(pkg.version)}"]
        if pkg.marker:
            out.append(f"marker = {_s(pkg.marker)}")
        if pkg.index:
            out.append(f"index = {_s(pkg.index)}")
        if pkg.sdist:
            out.append(f"sdist = {_file_inline(pkg.sdist)}")
        if pkg.wheels:
            out.append("wheels = [")
            out += [f"    {_file_inline(w)}," for w in pkg.wheels]
            out.append("]")
        if pkg.platforms:
            out += ["[packages.tool.cudaenv]", f"platforms = [{', '.join(map(_s, pkg.platforms))}]"]
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
    out += [f"{key} = {_s(value)}" for key, value in fields if value is not None]
    out.append(f"platforms = [{', '.join(map(_s, lock.platforms))}]")
    out.append(f"notes = [{', '.join(_s(n) for n in lock.notes)}]")
    return "\n".join(out) + "\n"


def packages_to_json(packages: Iterable[LockedPackage]) -> list[dict[str, Any]]:
    return [dataclasses.asdict(p) for p in packages]


def packages_from_json(items: list[dict[str, Any]]) -> tuple[LockedPackage, ...]:
    def file(d: dict[str, Any] | None) -> LockedFile | None:
        return LockedFile(**d) if d else None

    out = []
    for item in items:
        wheels = tuple(LockedFile(**w) for w in item.get("wheels", []))
        fields = {**item, "wheels": wheels, "sdist": file(item.get("sdist"))}
        fields["platforms"] = tuple(item.get("platforms", ()))
        out.append(LockedPackage(**fields))
    return tuple(out)


def write(lock: Lock, path: Path) -> None:
    """Atomically, so an interrupted lock never leaves half a file."""
    atomic_write_text(path, dumps(lock))


def lock_path(spec_source: Path, name: str) -> Path:
    """Where the lock of the spec ``name`` read from ``spec_source`` lives: ``locks/`` beside
    the spec file, as ``pylock.<name>.toml`` with every dot of the name turned into '-'.

    PEP 751 allows no dot in that name (uv refuses ``pylock.sglang-0.5.23-cu130.toml``; so
    does ``packaging.pylock.is_valid_pylock_path``); a spec name may have them. The lock keeps
    the spec's own name (``[tool.cudaenv] spec``), so two names folding to one file (``a.b``,
    ``a-b``) are told apart on read (:func:`read`). The only place lock paths are made.
    """
    return spec_source.parent / "locks" / f"pylock.{name.replace('.', '-')}.toml"


def read(path: Path, *, spec_name: str | None = None) -> Lock:
    """The lock at ``path``; with ``spec_name``, refused unless that spec wrote it."""
    lk = _read(path)
    if spec_name is not None:
        check_owner(lk, path, spec_name)
    return lk


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
        text = path.read_text()
    except OSError:
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
    """Parsed once per content: the memo (JSON, keyed by the file's sha256) makes reading the
    207-package default lock ~2 ms instead of ~30 ms of TOML and validation on every build."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BuildError(
            f"{path}: cannot read the lock ({exc.strerror}); run `cudaenv lock`"
        ) from exc
    # v2: locks with `platforms` (a memo of an older parse is never read back).
    memo = cache_dir() / "locks" / f"{hashlib.sha256(raw).hexdigest()}.v2.json"
    try:
        return _from_memo(json.loads(memo.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        pass
    lk = _parse(path, raw)
    with contextlib.suppress(OSError):  # only a cache
        atomic_write_text(memo, json.dumps(_to_memo(lk)))
    return lk


def _to_memo(lk: Lock) -> dict[str, Any]:
    doc = dataclasses.asdict(lk)
    doc["packages"] = packages_to_json(lk.packages)
    return doc


def _from_memo(doc: dict[str, Any]) -> Lock:
    fields = dict(doc)
    fields["packages"] = packages_from_json(doc["packages"])
    fields["notes"] = tuple(doc["notes"])
    fields["platforms"] = tuple(doc["platforms"])
    return Lock(**fields)


def _parse(path: Path, raw: bytes) -> Lock:
    try:
        doc = tomllib.loads(raw.decode())
    except UnicodeDecodeError as exc:
        raise BuildError(f"{path}: the lock is not UTF-8; run `cudaenv lock`") from exc
    except tomllib.TOMLDecodeError as exc:
        raise BuildError(f"{path}: not a valid TOML lock: {exc}; run `cudaenv lock`") from exc
    tool = doc.get("tool", {}).get("cudaenv") if isinstance(doc.get("tool"), dict) else None
    if not isinstance(tool, dict):
        raise BuildError(f"{path}: not a cudaenv lock (no [tool.cudaenv]); run `cudaenv lock`")
    try:
        packages = parse_packages(doc, str(path))
    except ResolveError as exc:
        raise BuildError(f"{exc}; run `cudaenv lock`") from exc

    def opt(key: str) -> str | None:
        value = tool.get(key)
        return str(value) if value is not None else None

    for key in ("spec", "fingerprint", "python", "cuda"):
        if not isinstance(tool.get(key), str):
            raise BuildError(f"{path}: [tool.cudaenv] lacks '{key}'; run `cudaenv lock`")
    notes = tool.get("notes", [])
    on = tool.get("platforms")
    if on is None and isinstance(tool.get("platform"), str):
        on = [platforms_mod.from_uv_tag(tool["platform"])]  # written before `platforms:`
    if not isinstance(on, list) or not on or not all(isinstance(p, str) for p in on):
        raise BuildError(f"{path}: [tool.cudaenv] lacks 'platforms'; run `cudaenv lock`")
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
    )
