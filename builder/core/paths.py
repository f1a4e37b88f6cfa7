"""Where cudaenv keeps things on disk: built envs, and its machine-wide cache.

One place, so the cache of interpreters, resolutions, channel pins and tools moves together
with ``XDG_CACHE_HOME`` (or ``CUDAENV_CACHE_DIR``), and tests can point all of it elsewhere.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from builder import store as jit_store
from builder.core import cachefiles, context, settings
from builder.core.errors import UsageError
from builder.core.owners import owned, safe_directory, who

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

# Built envs: .envs/ in the project root (git-ignored in this repository).
ENVS = ".envs"
# Matrix cells: .envs/.matrix/MATRIX/ holds each matrix's generated specs, locks and envs.
MATRIX = ".matrix"


def project_text(pyproject: Path) -> str:
    """The text of a project's ``pyproject.toml``, read once per command (core/context.py)
    however many steps ask (the project root, the lock mode, the JIT remote): keyed by the
    file's identity, so a file replaced meanwhile is read again. OSError as ``read_text``."""
    st = pyproject.stat()
    key = ("pyproject", str(pyproject.absolute()), st.st_dev, st.st_ino, st.st_mtime_ns)
    return context.once(key, pyproject.read_text)


def _declares_cudaenv(pyproject: Path) -> bool:
    """``pyproject`` has a ``[tool.cudaenv]`` table. One that cannot be read or parsed marks
    nothing: finding the root must not fail where ``cudaenv list`` would otherwise work."""
    try:
        doc = tomllib.loads(project_text(pyproject))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return False
    tool = doc.get("tool")
    return isinstance(tool, dict) and "cudaenv" in tool


def current_dir() -> Path:
    """The current directory, absolute; ``.`` where it was deleted under a running shell (then
    no project root is found and paths stay relative to it, as before there was one)."""
    try:
        return Path.cwd()
    except OSError:
        return Path()


def trusted_dirs(start: Path) -> list[Path]:
    """``start`` and the directories above it, up to the first that another user owns or can
    write (``/tmp`` is one), which ends the list: what lies there is not the user's project,
    whatever it holds. git stops the same way at a repository another user owns (its
    ``safe.directory`` rule, CVE-2022-24765); cudaenv often runs as root, and a
    ``pyproject.toml`` or an ``envspecs/`` planted in a shared parent would choose its
    registry, its envs dir and the interpreter it runs."""
    out: list[Path] = []
    for directory in (start, *start.parents):
        try:
            st = directory.stat()
        except OSError:
            break
        if not owned(st) and not safe_directory(directory):
            _say_ignored(directory, st)
            break
        out.append(directory)
    return out


def _say_ignored(directory: Path, st: os.stat_result) -> None:
    """One warning where the directory that ends the search holds what would have made it a
    project: a project there is the user's to vouch for (chown it, or move the project)."""
    found = [n for n in ("pyproject.toml", "envspecs") if (directory / n).exists()]
    if not found:
        return
    cachefiles.warn(
        f"{directory / found[0]} is not read: {directory} {who(st, mode=True)}, and cudaenv trusts no "
        "project directory another user could have written (as git's safe.directory rule)"
    )


def project_file(path: Path) -> bool:
    """``path`` is a regular file of the user's own (or root's) that no other user can write:
    a project file cudaenv may read (a FIFO or a device would hang or flood the read)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and owned(st)


def project_root(start: Path | None = None) -> Path | None:
    """The nearest directory at or above ``start`` (default: the current one) holding an
    ``envspecs/`` directory or a ``pyproject.toml`` with ``[tool.cudaenv]``, as uv and pixi
    find their project: ``cd envspecs && cudaenv verify default.yaml`` finds the env built
    from the root. None where no directory up to ``/`` is one; the search never goes past a
    directory another user owns or can write (:func:`trusted_dirs`)."""
    here = start.absolute() if start is not None else current_dir()
    for directory in trusted_dirs(here):
        envspecs = directory / "envspecs"
        if (envspecs.is_dir() and not envspecs.is_symlink() and owned(envspecs.stat())) or (
            project_file(directory / "pyproject.toml")
            and _declares_cudaenv(directory / "pyproject.toml")
        ):
            return directory
    return None


def envs_dir(start: Path | None = None) -> Path:
    """Where envs are built (absolute): ``.envs/`` in the project root, else in the current
    directory (outside any project, as before there was a root to find)."""
    here = start.absolute() if start is not None else current_dir()
    root = project_root(here)
    if root is not None:
        return root / ENVS
    # Outside any project the current directory holds the envs: one another user owns or can
    # write (/tmp) could hold her `.envs/NAME/bin/python`, which `run` would start as root.
    try:
        st = here.stat()
    except OSError:
        return here / ENVS
    if not owned(st) and not safe_directory(here):
        raise UsageError(
            f"{here} {who(st, mode=True)}: cudaenv keeps, lists and starts no envs there (as git's "
            "safe.directory rule); run it from a directory of your own, name the env's "
            f"directory with --env-dir, or trust this one with CUDAENV_SAFE_DIRECTORIES={here}"
        )
    return here / ENVS


def matrix_dir(start: Path | None = None) -> Path:
    return envs_dir(start) / MATRIX


def cache_dir() -> Path:
    """``$CUDAENV_CACHE_DIR``, else ``$XDG_CACHE_HOME/cudaenv``, else ``~/.cache/cudaenv``,
    where no other user can write it; else a private one for this run (cachefiles: what is
    read back or run from the cache follows the JIT store's trust rules)."""
    return cachefiles.cache_dir()


def jit_store_dir() -> Path | None:
    """The machine-wide store of compiled JIT results (builder/store/): ``$CUDAENV_JIT_STORE``
    (``off`` turns it off), else ``jit-store`` in the cache directory."""
    own = settings.current().jit_store
    if own == "off":
        return None
    return Path(own) if own else cache_dir() / "jit-store"


# The one Store of each root this process uses (a test may point CUDAENV_JIT_STORE elsewhere
# between calls): what one part of a run learnt of it (its notes, its memo of tool hashes)
# the next part sees.
_stores: dict[Path, jit_store.Store] = {}


def store_at(root: Path) -> jit_store.Store:
    """The store at ``root``, made once per process; its tree is checked again at the next
    use (``Store.ready``), as it was for each part of a run when each made its own."""
    if root not in _stores:
        _stores[root] = jit_store.Store(root)
    return _stores[root].judged_again()


def jit_store_here() -> jit_store.Store | None:
    """This process's JIT store (:func:`jit_store_dir`; not yet made or checked), None when it
    is off."""
    root = jit_store_dir()
    return None if root is None else store_at(root)
