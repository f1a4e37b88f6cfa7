"""``cudaenv.json``: what a built env is, typed and versioned.

Written once by the build, read by ``verify``, ``doctor``, ``matrix`` and ``build`` itself
(to tell an up-to-date env). Parsed at this edge into a frozen :class:`Manifest`; a file of
an unknown ``schema_version`` is a clear error naming the file, never a KeyError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from packaging.utils import canonicalize_name

from builder.core.errors import ReportError
from builder.core.proc import atomic_write_text
from builder.formats import codec
from builder.machine.archs import Arch
from builder.spec.envspec import ToolchainSource

FILE = "cudaenv.json"
# What an adopted env's manifest names instead of a spec file (`cudaenv adopt`).
ADOPTED_SPEC = "(adopted)"
SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Manifest:
    name: str
    spec: str  # the spec file it was built from, as given
    fingerprint: str
    lock_hash: str
    python: str
    cuda: str
    torch: str | None
    torch_cuda: str | None
    toolkit: str | None
    nvcc: str
    toolchain_source: ToolchainSource
    archs: tuple[Arch, ...]  # the env's list: the spec's plus the GPUs visible at build time
    spec_archs: tuple[Arch, ...]
    packages: tuple[tuple[str, str], ...]
    env: tuple[tuple[str, str], ...]
    built_at: str
    cudaenv: str
    path: str
    # Where the env runs (platforms.py); None in a manifest written before platforms.
    platform: str | None = None
    # Assembled on another machine (`cudaenv build --platform`): its files were checked, never
    # run; it holds no interpreter until made a venv on its platform.
    assembled: bool = False
    # The spec's `remote-cache:` URL the hook was written with; None: none.
    remote_cache: str | None = None
    # Each package built from its sdist at install: (name, version, the wheel's sha256, its
    # store key), so `fingerprint` and doctor know what was compiled here and how.
    source_builds: tuple[tuple[str, str, str, str], ...] = ()
    # The spec's `build-env:` those builds ran with: a change rebuilds the env.
    build_env: tuple[tuple[str, str], ...] = ()

    json_form: ClassVar[codec.Form] = codec.Form(
        head={"schema_version": SCHEMA_VERSION},
        sparse=("remote_cache", "source_builds", "build_env"),
    )

    def to_json(self) -> dict[str, object]:
        return codec.to_json(self)

    @classmethod
    def from_json(cls, doc: object, where: str) -> Manifest:
        return codec.from_json(cls, doc, where)


def exists(env_dir: Path) -> bool:
    return (env_dir / FILE).is_file()


def read(env_dir: Path) -> Manifest:
    """The manifest of ``env_dir``; ReportError (exit 2) when it is missing or unreadable."""
    path = env_dir / FILE
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ReportError(
            f"{path}: no readable manifest ({exc.strerror}); not an env built by cudaenv"
        ) from exc
    except ValueError as exc:
        raise ReportError(f"{path}: the manifest is not JSON ({exc})") from exc
    return Manifest.from_json(doc, str(path))


def source_built(env_dir: Path) -> frozenset[str]:
    """The packages the env at ``env_dir`` built from their sdists (its manifest's
    ``source_builds``), by canonical name; none for an env cudaenv did not build."""
    found = try_read(env_dir)
    if found is None:
        return frozenset()
    return frozenset(canonicalize_name(row[0]) for row in found.source_builds)


def try_read(env_dir: Path) -> Manifest | None:
    """The manifest, or None where there is none or it cannot be read (doctor, up-to-date
    checks: an unreadable manifest means "rebuild", not an error)."""
    try:
        return read(env_dir)
    except ReportError:
        return None


def write(manifest: Manifest, env_dir: Path) -> Path:
    return atomic_write_text(
        env_dir / FILE, json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n"
    )
