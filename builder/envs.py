"""The envs built here: ``cudaenv list``, ``remove`` and ``run``.

An env is a directory under ``.envs/`` with a manifest (``cudaenv.json``); matrix cells live
under ``.envs/.matrix/`` and are the matrix's own, so they are not listed.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import lock, manifest
from builder.errors import CudaenvError, SpecError, UsageError
from builder.paths import ENVS_DIR


@dataclass(frozen=True, kw_only=True)
class EnvInfo:
    name: str
    path: Path
    spec: str
    lock_state: str  # up to date | stale (...) | no spec | ...
    bytes_total: int  # every file once
    bytes_own: int  # files no other env or uv's cache shares (one link)
    verified: str | None  # "passed 2026-11-30T..." from the last verify report
    platform: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": str(self.path),
            "spec": self.spec,
            "lock": self.lock_state,
            "bytes": self.bytes_total,
            "bytes_not_shared": self.bytes_own,
            "last_verify": self.verified,
            "platform": self.platform,
        }


def resolve(name: str) -> Path:
    """An env by name (``.envs/NAME``) or by directory; UsageError when it is not one."""
    for path in (ENVS_DIR / name, Path(name)):
        if manifest.exists(path):
            return path.absolute()
    built = ", ".join(e.name for e in _dirs()) or "none"
    raise UsageError(f"{name}: no env of that name in {ENVS_DIR}/ (built here: {built})")


def _dirs() -> list[Path]:
    if not ENVS_DIR.is_dir():
        return []
    return sorted(
        p for p in ENVS_DIR.iterdir() if not p.name.startswith(".") and manifest.exists(p)
    )


def _sizes(root: Path) -> tuple[int, int]:
    seen: set[tuple[int, int]] = set()
    total = own = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                st = (Path(dirpath) / name).lstat()
            except OSError:
                continue
            ident = (st.st_dev, st.st_ino)
            if ident in seen:
                continue
            seen.add(ident)
            used = st.st_blocks * 512
            total += used
            if st.st_nlink == 1:
                own += used
    return total, own


def _lock_state(found: manifest.Manifest) -> str:
    from builder import spec as spec_mod

    if found.spec == manifest.ADOPTED_SPEC:
        return found.spec
    source = Path(found.spec)
    if not source.is_file():
        return "no spec file"
    try:
        s = spec_mod.load(source)
    except SpecError:
        return f"spec {source} does not load"
    if s.fingerprint() != found.fingerprint:
        return f"stale: {source} changed since the build"
    path = lock.lock_path(s.source, s.name)
    try:
        lk = lock.read(path, spec_name=s.name)
    except CudaenvError:  # any unreadable lock means "needs a re-lock", not a crash
        return f"stale: {path.name} is not readable"
    return "up to date" if lk.content_hash() == found.lock_hash else f"stale: {path.name} changed"


def _last_verify(root: Path) -> str | None:
    try:
        doc = json.loads((root / "var" / "cudaenv" / "verify.json").read_text())
    except (OSError, ValueError):
        return None
    checks = doc.get("checks") if isinstance(doc, dict) else None
    if not isinstance(checks, list):
        return None
    failed = any(isinstance(c, dict) and c.get("status") == "failed" for c in checks)
    return f"{'failed' if failed else 'passed'} {doc.get('created', '?')}"


def listing() -> list[EnvInfo]:
    out = []
    for path in _dirs():
        found = manifest.try_read(path)
        if found is None:
            continue
        total, own = _sizes(path)
        out.append(
            EnvInfo(
                name=path.name,
                path=path.absolute(),
                spec=found.spec,
                lock_state=_lock_state(found),
                bytes_total=total,
                bytes_own=own,
                verified=_last_verify(path),
                platform=found.platform,
            )
        )
    return out


def remove(path: Path) -> None:
    """Delete the env at ``path`` whole, waiting for a build of it to finish first; it is
    renamed aside before deletion, so an interrupted remove leaves no half env."""
    from builder import build

    with build.env_lock(path, lambda _msg: None):
        aside = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.rename(path, aside)
        shutil.rmtree(aside, ignore_errors=True)


def human(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
