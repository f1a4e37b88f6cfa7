"""Read and write PEP 751 ``pylock.NAME.toml`` files with the spec fingerprint they came from.

The committed lock names every file by its wheel/sdist file name, size and sha256 but keeps
no download URL: installs go through uv's index configuration on the machine that builds,
and the hashes make any index (a mirror, a proxy, a wheelhouse) give exactly these files.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.errors import BuildError, ResolveError
from builder.proc import atomic_write_text

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
    # Kept only for packages a spec pins to an index: the exact file on that index.
    url: str | None = None


@dataclass(frozen=True, kw_only=True)
class LockedPackage:
    name: str
    version: str
    marker: str | None = None
    wheels: tuple[LockedFile, ...] = ()
    sdist: LockedFile | None = None
    index: str | None = None  # the index the spec pins this package to

    @property
    def hashes(self) -> tuple[str, ...]:
        files = [*self.wheels, *([self.sdist] if self.sdist else [])]
        return tuple(f.sha256 for f in files)


@dataclass(frozen=True, kw_only=True)
class Lock:
    spec_name: str
    fingerprint: str
    python: str
    platform: str
    cuda: str
    torch: str | None
    torch_cuda: str | None
    toolkit: str | None  # the cuda-toolkit version every component is pinned to
    packages: tuple[LockedPackage, ...]
    command: str = ""
    notes: tuple[str, ...] = ()

    def requirements_txt(self) -> str:
        """``name==version --hash=...`` lines for ``uv pip sync --require-hashes``."""
        lines = []
        for pkg in self.packages:
            marker = f" ; {pkg.marker}" if pkg.marker else ""
            hashes = " ".join(f"--hash=sha256:{h}" for h in pkg.hashes)
            pinned = next((f.url for f in pkg.wheels if f.url), None)
            if pkg.index and pinned:
                # The exact file of the pinned index: no other index is asked for it.
                lines.append(f"{pkg.name} @ {pinned}{marker} {hashes}")
            else:
                lines.append(f"{pkg.name}=={pkg.version}{marker} {hashes}")
        return "\n".join(lines) + "\n"

    def content_hash(self) -> str:
        """Identifies exactly what gets installed (names, versions, file hashes)."""
        h = hashlib.sha256()
        for pkg in self.packages:
            h.update(f"{pkg.name}=={pkg.version};{','.join(sorted(pkg.hashes))}\n".encode())
        return "sha256:" + h.hexdigest()


def _file(entry: dict[str, Any], where: str) -> LockedFile:
    hashes = entry.get("hashes")
    if not isinstance(hashes, dict) or not isinstance(hashes.get("sha256"), str):
        raise ResolveError(f"{where}: a file without a sha256 hash cannot be installed safely")
    name = entry.get("name")
    if not isinstance(name, str):
        url = entry.get("url") or entry.get("path")
        if not isinstance(url, str):
            raise ResolveError(f"{where}: a file needs a name, url or path")
        name = url.rsplit("/", 1)[-1]
    size = entry.get("size")
    upload = entry.get("upload-time")
    raw_url = entry.get("url")
    return LockedFile(
        url=raw_url if isinstance(raw_url, str) else None,
        name=name,
        sha256=hashes["sha256"],
        size=size if isinstance(size, int) else None,
        upload_time=upload.isoformat()
        if isinstance(upload, dt.datetime)
        else (str(upload) if upload is not None else None),
    )


def parse_packages(doc: dict[str, Any], where: str) -> tuple[LockedPackage, ...]:
    """The ``[[packages]]`` of a PEP 751 document (ours or uv's)."""
    out = []
    raw = doc.get("packages")
    if not isinstance(raw, list):
        raise ResolveError(f"{where}: no [[packages]] table")
    for i, entry in enumerate(raw):
        here = f"{where}: packages[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ResolveError(f"{here}: a package needs a name")
        if not isinstance(entry.get("version"), str):
            raise ResolveError(f"{here} ({entry['name']}): a package needs an exact version")
        wheels = tuple(_file(w, f"{here}.wheels") for w in entry.get("wheels") or [])
        sdist = (
            _file(entry["sdist"], f"{here}.sdist") if isinstance(entry.get("sdist"), dict) else None
        )
        if not wheels and sdist is None:
            raise ResolveError(f"{here} ({entry['name']}): no wheel or sdist to install")
        marker = entry.get("marker")
        index = entry.get("index")
        out.append(
            LockedPackage(
                name=entry["name"],
                version=entry["version"],
                marker=marker if isinstance(marker, str) else None,
                wheels=wheels,
                sdist=sdist,
                index=index if isinstance(index, str) else None,
            )
        )
    return tuple(sorted(out, key=lambda p: p.name))


def _s(value: str) -> str:
    """A TOML basic string: JSON's string escapes are all valid TOML escapes."""
    return json.dumps(value, ensure_ascii=False)


def _file_inline(f: LockedFile) -> str:
    parts = [f"name = {_s(f.name)}"]
    if f.url:
        parts.append(f"url = {_s(f.url)}")
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
    out = [
        f"# This file was generated by `{lock.command or 'cudaenv lock'}`; do not edit.",
        "# PEP 751 lock. Files are named and hash-pinned; only files of a package the spec pins to",
        "# an index keep their URL. The rest are fetched through the index uv is configured with.",
        'lock-version = "1.0"',
        f"environments = [{_s(_environment_marker(lock.platform))}]",
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
    out += ["", "[tool.cudaenv]"]
    fields = (
        ("spec", lock.spec_name),
        ("fingerprint", lock.fingerprint),
        ("python", lock.python),
        ("platform", lock.platform),
        ("cuda", lock.cuda),
        ("torch", lock.torch),
        ("torch-cuda", lock.torch_cuda),
        ("toolkit", lock.toolkit),
    )
    out += [f"{key} = {_s(value)}" for key, value in fields if value is not None]
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
        out.append(LockedPackage(**{**item, "wheels": wheels, "sdist": file(item.get("sdist"))}))
    return tuple(out)


def _environment_marker(platform: str) -> str:
    machine = platform.split("-", 1)[0]
    return f"sys_platform == 'linux' and platform_machine == '{machine}'"


def write(lock: Lock, path: Path) -> None:
    """Atomically, so an interrupted lock never leaves half a file."""
    atomic_write_text(path, dumps(lock))


def lock_path(spec_source: Path, name: str) -> Path:
    """Where the lock of the spec ``name`` read from ``spec_source`` lives: ``locks/`` beside
    the spec file."""
    return spec_source.parent / "locks" / f"pylock.{name}.toml"


def read(path: Path) -> Lock:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise BuildError(
            f"{path}: cannot read the lock ({exc.strerror}); run `cudaenv lock`"
        ) from exc
    except tomllib.TOMLDecodeError as exc:
        raise BuildError(f"{path}: not a valid TOML lock: {exc}; run `cudaenv lock`") from exc
    tool = doc.get("tool", {}).get("cudaenv") if isinstance(doc.get("tool"), dict) else None
    if not isinstance(tool, dict):
        raise BuildError(f"{path}: not a cudaenv lock (no [tool.cudaenv]); run `cudaenv lock`")
    try:
        packages = parse_packages(doc, str(path))
    except ResolveError as exc:
        raise BuildError(str(exc)) from exc

    def opt(key: str) -> str | None:
        value = tool.get(key)
        return str(value) if value is not None else None

    for key in ("spec", "fingerprint", "python", "platform", "cuda"):
        if not isinstance(tool.get(key), str):
            raise BuildError(f"{path}: [tool.cudaenv] lacks '{key}'; run `cudaenv lock`")
    notes = tool.get("notes", [])
    return Lock(
        spec_name=tool["spec"],
        fingerprint=tool["fingerprint"],
        python=tool["python"],
        platform=tool["platform"],
        cuda=tool["cuda"],
        torch=opt("torch"),
        torch_cuda=opt("torch-cuda"),
        toolkit=opt("toolkit"),
        packages=packages,
        notes=tuple(str(n) for n in notes) if isinstance(notes, list) else (),
    )
