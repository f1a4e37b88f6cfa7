"""The lock's data model: :class:`Lock`, its :class:`LockedPackage` entries and their
:class:`LockedFile` files, what a lock installs on each platform, and :func:`served_by`, which
says whether a file URL is one of an index's.

Reading and writing the PEP 751 text, and the trust rules a lock is held to on read, are
:mod:`builder.spec.lock`'s.
"""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass
from typing import ClassVar

from builder.core import context, indexview
from builder.core.errors import BuildError
from builder.formats import codec


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
    # The index view it was resolved against (indexview.py): the cut-off uv's --exclude-newer
    # was given, and the packages seen as of another time (--upgrade-package, a package the
    # spec named later). None in a lock written before cudaenv recorded it: see view().
    exclude_newer: str | None = None
    exclude_newer_packages: tuple[tuple[str, str], ...] = ()
    # The memo of a lock without a view is what an earlier release wrote, byte for byte.
    json_form: ClassVar[codec.Form] = codec.Form(sparse=("exclude_newer", "exclude_newer_packages"))

    def view(self, origin: str = "kept from the lock") -> indexview.View:
        """The view a re-lock resolves against: the recorded one, else the first second after
        the newest upload time of its files (under which every locked file is seen); packages
        whose files carry no upload time are exempt. ``View()`` (now) when no file has one."""
        at = self.exclude_newer
        if at is None:
            at = indexview.after(
                f.upload_time for p in self.packages for f in p.files if f.upload_time
            )
            origin = "the newest upload time of the lock's files"
        if at is None:
            return indexview.View()
        exempt = sorted({p.name for p in self.packages if any(not f.upload_time for f in p.files)})
        return indexview.View(
            at=at, packages=self.exclude_newer_packages, exempt=tuple(exempt), origin=origin
        )

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
            index = pkg.index
            pinned = next((f.url for f in pkg.wheels if f.url), None) if index else None
            if index and pinned and served_by(pinned, index):
                # The exact file of the pinned index: no other index is asked for it. The only
                # URL of a lock ever fetched; lock.read has held the index to the spec's pin.
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
        """Identifies exactly what gets installed (names, versions, file hashes). Made once
        per lock object (it is frozen): a build asks for it up to four times."""
        return context.kept_on(self, "content_hash()", self._content_hash)

    def _content_hash(self) -> str:
        h = hashlib.sha256()
        for pkg in self.packages:
            h.update(f"{pkg.name}=={pkg.version};{','.join(sorted(pkg.hashes))}\n".encode())
        return "sha256:" + h.hexdigest()


def served_by(url: str, index: str) -> bool:
    """Whether ``url`` is a file of the index at ``index`` (a PEP 503 ``.../simple`` URL, or a
    flat one like download.pytorch.org/whl/cu130): below the index's own URL, or below its
    root when it ends in ``/simple``; never through a ``..`` or ``.`` segment."""
    base = index.rstrip("/")
    base = base.removesuffix("/simple")
    if not url.startswith(base + "/"):
        return False
    rest = url[len(base) + 1 :].split("?", 1)[0].split("#", 1)[0]
    return not any(part in ("", ".", "..") for part in rest.split("/"))
