"""The project's own settings: ``[tool.cudaenv]`` in the nearest ``pyproject.toml`` above a spec.

What a lock names its files by, and where the JIT store's registry tier is:

- ``locks = "urls"`` (the default): each file's ``url`` as uv resolved it, so any PEP 751
  reader (uv, pip >= 26) installs the lock as it is.
- ``locks = "index-neutral"``: no index host in the lock. Each file gets
  ``path = "<wheelhouse>/<file name>"``, relative to the lock file's directory (PEP 751 allows
  that), and ``cudaenv export SPEC`` fills that wheelhouse, hash-checked, from whatever index
  the machine uses. A repository whose locks are read on machines behind different mirrors
  (this one) needs that.

- ``jit-remote = "oci://HOST[:PORT]/REPO"``: the registry the JIT store pulls from on a local
  miss (``builder/jit/share.py``); ``CUDAENV_JIT_REMOTE`` overrides it.

A package a spec pins to an index (``indexes:``) keeps its URL in both modes: that host is the
spec's own choice. ``cudaenv build`` installs by name, version and hash through the machine's
index in both modes.
"""

from __future__ import annotations

import posixpath
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from builder.core import paths, settings
from builder.core.errors import SpecError
from builder.formats.yamldoc import display, kind, suggest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

LOCK_MODES = ("urls", "index-neutral")
KEYS = ("locks", "wheelhouse", "jit-remote")


@dataclass(frozen=True, kw_only=True)
class Settings:
    locks: str = "urls"
    # Relative to each lock file's directory, in POSIX form (it is written into the lock).
    wheelhouse: str = "wheels"
    # The JIT store's registry tier (oci://HOST[:PORT]/REPO); CUDAENV_JIT_REMOTE wins over it.
    jit_remote: str | None = None
    source: Path | None = None  # the pyproject.toml they came from; None: the defaults

    @property
    def lock_wheelhouse(self) -> str | None:
        """The directory an index-neutral lock names its files in; None when locks carry URLs."""
        return self.wheelhouse if self.locks == "index-neutral" else None


def find_pyproject(spec_source: Path) -> Path | None:
    """The nearest ``pyproject.toml`` in the spec's directory or above it. The nearest one
    decides, with or without a ``[tool.cudaenv]`` table, as for ruff and pytest: a project
    nested in another is its own project. The search stops at a directory another user owns
    or can write, and a file another user could have written is not read
    (paths.trusted_dirs: git's ``safe.directory`` rule)."""
    for directory in paths.trusted_dirs(spec_source.absolute().parent):
        candidate = directory / "pyproject.toml"
        if paths.project_file(candidate):
            return candidate
    return None


def settings_for(spec_source: Path) -> Settings:
    """The settings of the project the spec at ``spec_source`` belongs to. Raises SpecError
    with every problem of the table at once."""
    path = find_pyproject(spec_source)
    if path is None:
        return Settings()
    where = display(path)
    try:
        doc = tomllib.loads(paths.project_text(path))
    except OSError as exc:
        raise SpecError([f"{where}: cannot read it ({exc.strerror})"], "project settings") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SpecError([f"{where}: not valid TOML: {exc}"], "project settings") from exc
    except RecursionError:  # tomllib recurses once per nested array: 5,000 deep is a traceback
        raise SpecError(
            [f"{where}: not valid TOML: nested too deep for a settings file"], "project settings"
        ) from None
    tool = doc.get("tool")
    table = tool.get("cudaenv") if isinstance(tool, dict) else None
    if table is None:
        return Settings(source=path)
    if not isinstance(table, dict):
        raise SpecError(
            [f"{where}: tool.cudaenv: expected a table, got {kind(table)}"], "project settings"
        )
    return _validated(table, where, path)


def _validated(table: dict[str, Any], where: str, path: Path) -> Settings:
    problems = [
        f"{where}: tool.cudaenv.{key}: {suggest(key, KEYS)}" for key in table if key not in KEYS
    ]
    locks = table.get("locks", Settings.locks)
    if locks not in LOCK_MODES:
        shown = repr(locks) if isinstance(locks, str) else kind(locks)
        problems.append(
            f"{where}: tool.cudaenv.locks: expected one of {', '.join(map(repr, LOCK_MODES))}, "
            f"got {shown}"
        )
    wheelhouse = table.get("wheelhouse", Settings.wheelhouse)
    if not isinstance(wheelhouse, str) or not wheelhouse.strip():
        problems.append(
            f"{where}: tool.cudaenv.wheelhouse: expected a directory relative to the lock files, "
            f"got {kind(wheelhouse)}"
        )
    elif "\\" in wheelhouse or PurePosixPath(wheelhouse).is_absolute():
        # It is written into every lock: a machine's own absolute path or a Windows separator
        # would make the lock unreadable elsewhere.
        problems.append(
            f"{where}: tool.cudaenv.wheelhouse: {wheelhouse!r} must be a relative POSIX path "
            "(relative to the lock file's directory)"
        )
    remote = table.get("jit-remote")
    if remote is not None and not (isinstance(remote, str) and remote.startswith("oci://")):
        shown = repr(remote) if isinstance(remote, str) else kind(remote)
        problems.append(
            f"{where}: tool.cudaenv.jit-remote: expected oci://HOST[:PORT]/REPO, got {shown}"
        )
    if problems:
        raise SpecError(problems, "project settings")
    assert isinstance(locks, str) and isinstance(wheelhouse, str)
    return Settings(
        locks=locks,
        wheelhouse=posixpath.normpath(wheelhouse),
        jit_remote=remote,
        source=path,
    )


def applied(found: settings.Settings, spec: object = None) -> settings.Settings:
    """``found`` with the ``[tool.cudaenv]`` values of the project ``spec`` (a spec's path;
    None: the current directory) belongs to, under the environment's (the cascade is
    settings.py's). A table that cannot be read adds nothing here: the command that reads it
    says why, located."""
    where = Path(spec) if isinstance(spec, (str, Path)) else Path("pyproject.toml")
    try:
        own = settings_for(where)
    except SpecError:
        return found
    return found.with_pyproject({"jit_remote": own.jit_remote}, own.source)
