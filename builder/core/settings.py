"""cudaenv's own configuration, read once: one frozen :class:`Settings` per process.

Every variable cudaenv itself reads as configuration is a row of ``variables.TABLE`` with a
:class:`~builder.core.variables.Setting` (its field here, its type, its default); nothing else in
``builder/`` reads them from the environment. Each value is taken from the first of, as
cibuildwheel's options are:

1. the command line (``--debug``, ``--quiet``);
2. the environment (``CUDAENV_JIT_REMOTE=...``);
3. ``[tool.cudaenv]`` of the project's ``pyproject.toml`` (``jit-remote``; project.py reads
   and checks that table);
4. the row's default.

Each value keeps where it came from (:attr:`Settings.origins`); ``cudaenv --debug`` prints
them before any work (:func:`describe`). The CLI resolves them at start-up, where a value that
is not of its type is one line naming the variable and the value (exit 2,
:func:`establish`); a process started otherwise (the probe's ``python -m builder.jit.share``)
takes the default in its place, as it did before, and says so in the origin.

The environment is read when the settings are first asked for and again only where it has
changed since (a test that sets a variable in-process); cudaenv itself never changes its own
environment. What a child process is given is :func:`child_environ`.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from builder.core import variables
from builder.core.errors import UsageError

DEFAULT = "default"
COMMAND_LINE = "command line"
# The fields only the command line sets.
FLAGS = ("debug", "quiet")
ROWS: tuple[variables.Variable, ...] = tuple(v for v in variables.TABLE if v.setting)


@dataclass(frozen=True, kw_only=True)
class Settings:
    # Flags of the command line.
    debug: bool = False
    quiet: bool = False
    # Where cudaenv keeps its cache: CUDAENV_CACHE_DIR, else $XDG_CACHE_HOME/cudaenv, else
    # ~/.cache/cudaenv (cachefiles judges whether it may be used).
    cache_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "cudaenv")
    xdg_cache_home: Path | None = None
    # The JIT store: "" in the cache directory, "off" none, else its directory.
    jit_store: str | None = None
    jit_store_max: int = 10 << 30
    jit_lock_timeout: float = 900.0
    source_build_timeout: float = 14400.0  # one package's compile from its sdist
    jit_remote: str | None = None  # oci://HOST[:PORT]/REPO; None: no remote
    jit_push: bool = False
    no_prefetch: bool = False  # build and adopt place no warmed JIT entries
    jit_remote_insecure: bool = False
    jit_remote_timeout: float = 30.0
    jit_signing_key: Path | None = None
    jit_allowed_signers: Path | None = None
    jit_require_signed: bool = False
    remote_cache: str | None = None  # redis://...; None: none (`off` or unset)
    remote_cache_password: str | None = None
    uv: str | None = None
    # Directories (os.pathsep-separated, `*` all) trusted although another user owns or can
    # write them (owners.py): git's safe.directory.
    safe_directories: str | None = None
    exclude_newer: str | None = None  # the index view of a fresh resolution (indexview.py)
    driver_version: str | None = None
    probe_timeout: float = 10.0
    heartbeat_seconds: float = 15.0
    gpu_check: bool = False
    github_step_summary: Path | None = None
    docker_config: Path | None = None
    virtual_env: Path | None = None
    cuda_home: Path | None = None
    cuda_path: Path | None = None
    flashinfer_arch_list: str | None = None
    cc: str | None = None
    pyenv_root: Path | None = None
    conda_prefix: str | None = None
    conda_exe: str | None = None
    # Field name -> where its value came from: "default", "--debug", "CUDAENV_X", or
    # "PATH [tool.cudaenv] KEY".
    origins: Mapping[str, str] = field(default_factory=dict, compare=False)

    @property
    def jit_store_off(self) -> bool:
        return self.jit_store == "off"

    def origin(self, name: str) -> str:
        return self.origins.get(name, DEFAULT)

    def with_pyproject(self, values: Mapping[str, object], source: Path | None) -> Settings:
        """These settings with a project's ``[tool.cudaenv]`` values (field name -> value,
        None: the project does not set it) where neither a flag nor a variable set one."""
        changes: dict[str, Any] = {}
        origins = dict(self.origins)
        for row in ROWS:
            assert row.setting is not None
            name = row.setting.field
            value = values.get(name)
            if row.setting.pyproject is None or value is None or self.origin(name) != DEFAULT:
                continue
            changes[name] = value
            origins[name] = f"{source} [tool.cudaenv] {row.setting.pyproject}"
        return replace(self, **changes, origins=origins) if changes else self


def _typed(row: variables.Variable, text: str) -> object:
    """The value of ``row`` spelled ``text`` (already checked)."""
    assert row.setting is not None
    if row.number is not None:
        if row.number.unit == "size":
            from builder.store import parse_size

            return parse_size(text)
        return float(text)
    kind = row.setting.type
    if kind == "switch":
        return text.strip() == "1"
    if kind == "path":
        return Path(text) if text else None
    if kind in ("remote", "redis"):
        return None if text in ("", "off") else text
    return text or None


def problem(row: variables.Variable, text: str) -> str | None:
    """Why ``text`` is not a value of ``row``; None when it is one."""
    if text == "":
        return None
    if row.setting is not None and row.setting.type == "redis" and text != "off":
        from builder.core import remote_cache

        try:
            remote_cache.parse(text)
        except remote_cache.RemoteCacheError as exc:
            return str(exc)
        return None
    if row.setting is not None and row.setting.type == "time":
        from builder.core import indexview

        return indexview.problem(text)
    if row.number is None:
        return None
    return variables.number_problem(row.number, text)


def resolve(
    environ: Mapping[str, str], *, flags: Mapping[str, object] | None = None, strict: bool = False
) -> Settings:
    """The settings ``flags`` (field -> value given on the command line; None: not given) and
    ``environ`` make. A value that is not of its variable's type is a UsageError naming the
    variable and the value where ``strict``, else the default (its origin says why)."""
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    known = {f.name for f in fields(Settings)} - {"origins"}
    for name, value in (flags or {}).items():
        if name not in known:
            raise ValueError(f"not a setting: {name}")
        if value is not None and value is not False:
            values[name], origins[name] = value, COMMAND_LINE
    for row in ROWS:
        assert row.setting is not None
        if row.setting.field in origins:
            continue
        text = environ.get(row.name, "")
        why = problem(row, text)
        if why is not None:
            shown = _masked(text) if row.setting.secret else text
            if strict:
                raise UsageError(f"{row.name}={shown}: {why}")
            origins[row.setting.field] = f"{DEFAULT} ({row.name}={shown} refused: {why})"
            continue
        if text == "":
            if row.setting.default:
                values[row.setting.field] = _typed(row, row.setting.default)
            continue
        values[row.setting.field] = _typed(row, text)
        origins[row.setting.field] = row.name
    if "cache_dir" not in values:
        xdg = values.get("xdg_cache_home")
        if isinstance(xdg, Path):
            values["cache_dir"] = xdg / "cudaenv"
            origins["cache_dir"] = "XDG_CACHE_HOME"
    return Settings(**values, origins=origins)


def _snapshot(environ: Mapping[str, str]) -> tuple[str | None, ...]:
    return tuple(environ.get(row.name) for row in ROWS)


_flags: dict[str, object] = {}
_resolved: tuple[tuple[str | None, ...], Settings] | None = None


def establish(**flags: object) -> Settings:
    """The process's settings, resolved at start-up with what the command line gave
    (``debug=True``); UsageError (exit 2) for a variable whose value is not of its type,
    before any work."""
    global _resolved
    _flags.clear()
    _flags.update(flags)
    found = resolve(os.environ, flags=_flags, strict=True)
    _resolved = (_snapshot(os.environ), found)
    return found


def current() -> Settings:
    """The process's settings: resolved once, again only where the environment has changed."""
    global _resolved
    snapshot = _snapshot(os.environ)
    if _resolved is None or _resolved[0] != snapshot:
        _resolved = (snapshot, resolve(os.environ, flags=_flags))
    return _resolved[1]


def of(environ: Mapping[str, str] | None) -> Settings:
    """The settings of ``environ`` (a child's, a test's), or this process's where None."""
    return current() if environ is None else resolve(environ)


def child_environ(**changes: str | None) -> dict[str, str]:
    """The environment to give a child process: ours, with ``changes`` (None removes one)."""
    env = dict(os.environ)
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def _shown(value: object) -> str:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return "(unset)" if value is None else str(value)


def _masked(value: str) -> str:
    """A secret setting as ``--debug`` shows it: a URL without its password, else ``***``."""
    if "://" not in value:
        return "***"
    # Up to the last "@", as urlsplit reads a URL: a password may hold "@" or "/" unquoted.
    scheme, _, rest = value.partition("://")
    auth, at, host = rest.rpartition("@")
    if not at or ":" not in auth:
        return value
    return f"{scheme}://{auth.partition(':')[0]}:***@{host}"


def show(found: Settings) -> None:
    """``--debug``'s account of the settings, on stderr before any work."""
    for line in describe(found):
        print(f"cudaenv: setting {line}", file=sys.stderr, flush=True)


def describe(found: Settings) -> list[str]:
    """One line per setting, ``name = value  (where it came from)``, as ``--debug`` prints
    them: the variable's name where one sets it."""
    by_field = {row.setting.field: row.name for row in ROWS if row.setting is not None}
    secret = {row.setting.field for row in ROWS if row.setting is not None and row.setting.secret}
    lines = []
    for f in fields(found):
        if f.name == "origins":
            continue
        label = by_field.get(f.name, f"--{f.name}")
        value = getattr(found, f.name)
        if f.name in secret and value is not None:
            value = _masked(str(value))
        lines.append(f"{label} = {_shown(value)}  ({found.origin(f.name)})")
    return lines
