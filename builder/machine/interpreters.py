"""Find an interpreter of the spec's Python on this machine.

uv alone misses pyenv's non-global versions (the shim refuses them) and then tries to
download a managed Python, which fails offline. So: uv's own discovery with downloads off,
``python3.X`` on PATH (run, not just found: a pyenv shim exists but fails), pyenv's
``versions/``, conda's envs; only then a uv download, and if that fails too, an error that
lists what was found and how to get the version asked for.
"""

from __future__ import annotations

import glob
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from builder.core import cachefiles, proc, settings
from builder.core.errors import ToolMissing, UsageError
from builder.core.paths import cache_dir

_PROBE = "import sys; print('%d.%d.%d' % sys.version_info[:3])"


@dataclass(frozen=True, kw_only=True)
class Interpreter:
    path: Path
    version: str  # 3.12.1
    found_by: str


def _version_of(path: str) -> str | None:
    try:
        done = proc.run([path, "-c", _PROBE], check=False, timeout=20)
    except (ToolMissing, proc.CommandFailed):
        return None
    out = done.stdout.strip()
    return out if done.returncode == 0 and re.match(r"^\d+\.\d+\.\d+$", out) else None


def python_arg(text: str) -> Path:
    """A ``--python`` argument: an interpreter, or an env directory (its ``bin/python``).

    Anything else is a one-line UsageError saying why. The interpreter is run once, because an
    executable file is not yet a Python (``/bin/true``, a pyenv shim of an uninstalled
    version). The path is returned as given, not resolved: a venv's ``bin/python`` is a
    symlink to its base interpreter, and the resolved path would diagnose the base, not the env.
    """

    def refuse(why: str) -> UsageError:
        return UsageError(f"{text}: not a Python interpreter ({why})")

    path = Path(text).expanduser()
    on_path = proc.which(text) if os.sep not in text else None
    if on_path and not path.exists():  # a bare name (`--python python3.12`), as exec finds it
        path = Path(on_path)
    if path.is_dir():
        if not (path / "bin" / "python").exists():
            raise refuse("a directory without bin/python")
        path = path / "bin" / "python"
    if not path.exists():
        raise refuse("no such file")
    if not path.is_file():
        raise refuse("not a file")
    if not os.access(path, os.X_OK):
        raise refuse("not executable")
    try:
        # Empty stdin: an executable that reads it (cat-like) must not wait on the terminal.
        done = proc.run([path, "-c", _PROBE], check=False, timeout=20, input_text="")
    except proc.CommandFailed as exc:
        raise refuse(f"it did not answer within {exc.timed_out or 20:g} s") from exc
    except (ToolMissing, OSError) as exc:
        raise refuse(f"it cannot be run: {exc}") from exc
    out = done.stdout.strip()
    if done.returncode == 0 and re.match(r"^\d+\.\d+\.\d+$", out):
        return path
    if done.returncode == 0:
        raise refuse("it ran but printed no Python version")
    said = (done.stderr.strip() or out).splitlines()[-1:]
    detail = f": {said[0][:200]}" if said else ""
    raise refuse(f"it does not run as Python: exit {done.returncode}{detail}")


def _candidates(minor: str) -> list[tuple[str, str]]:
    """(path, how it was found), in preference order; not yet run."""
    out: list[tuple[str, str]] = []
    env = settings.child_environ(UV_PYTHON_DOWNLOADS="never")
    try:
        done = proc.run(
            [proc.uv_bin(), "python", "find", minor, "--no-python-downloads"],
            env=env,
            check=False,
            timeout=30,
        )
        if done.returncode == 0 and done.stdout.strip():
            out.append((done.stdout.strip().splitlines()[-1], "uv python find"))
    except (ToolMissing, proc.CommandFailed):
        pass
    on_path = proc.which(f"python{minor}")
    if on_path:
        out.append((on_path, "PATH"))
    found = settings.current()
    pyenv_root = str(found.pyenv_root or Path.home() / ".pyenv")
    for exe in sorted(
        glob.glob(f"{pyenv_root}/versions/{minor}.*/bin/python{minor}"), reverse=True
    ):
        out.append((exe, "pyenv versions"))
    conda_roots = [found.conda_prefix or "", found.conda_exe or ""]
    conda_roots = [
        str(Path(r).parent.parent) if r.endswith("/bin/conda") else r for r in conda_roots
    ]
    conda_roots += [
        str(Path.home() / d) for d in ("miniconda3", "anaconda3", "miniforge3", "mambaforge")
    ]
    conda_roots.append("/opt/conda")
    for root in dict.fromkeys(r for r in conda_roots if r):
        for exe in (
            f"{root}/bin/python{minor}",
            *sorted(glob.glob(f"{root}/envs/*/bin/python{minor}")),
        ):
            out.append((exe, "conda"))
    for exe in (f"/usr/local/bin/python{minor}", f"/usr/bin/python{minor}"):
        out.append((exe, "system"))
    return out


def _cache_file() -> Path:
    return cache_dir() / "pythons.json"


def _cached(minor: str) -> Interpreter | None:
    """The last interpreter found for ``minor``, if its executable is unchanged (same inode,
    size, mtime): discovery runs uv and pyenv shims (~0.5 s) and a build should not pay it."""
    # A build runs the interpreter this names: taken only under the cache's trust rules.
    doc = cachefiles.read_json(_cache_file())
    try:
        entry = doc[minor]
        st = Path(entry["path"]).stat()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if [st.st_ino, st.st_size, st.st_mtime_ns] != entry.get("stat"):
        return None
    return Interpreter(
        path=Path(entry["path"]), version=entry["version"], found_by=f"{entry['found_by']}, cached"
    )


def _remember(found: Interpreter) -> None:
    path = _cache_file()
    doc = cachefiles.read_json(path)
    if not isinstance(doc, dict):
        doc = {}
    try:
        st = found.path.stat()
    except OSError:
        return  # only a cache
    doc[found.version.rsplit(".", 1)[0]] = {
        "path": str(found.path),
        "version": found.version,
        "found_by": found.found_by,
        "stat": [st.st_ino, st.st_size, st.st_mtime_ns],
    }
    cachefiles.write_text(path, json.dumps(doc, indent=1))


def find(minor: str, *, allow_download: bool = True) -> Interpreter:
    """An interpreter whose ``major.minor`` is ``minor``; raises ToolMissing with what exists."""
    cached = _cached(minor)
    if cached is not None:
        return cached
    found = _find(minor, allow_download=allow_download)
    _remember(found)
    return found


def _find(minor: str, *, allow_download: bool) -> Interpreter:
    tried: dict[str, str] = {}
    for exe, how in _candidates(minor):
        real = os.path.realpath(exe)
        if real in tried or not Path(exe).exists():
            continue
        version = _version_of(exe)
        tried[real] = version or "does not run"
        if version and version.rsplit(".", 1)[0] == minor:
            return Interpreter(path=Path(exe), version=version, found_by=how)
    if allow_download:
        try:
            done = proc.run([proc.uv_bin(), "python", "install", minor], check=False, timeout=300)
            if done.returncode == 0:
                found = proc.run(
                    [proc.uv_bin(), "python", "find", minor, "--no-python-downloads"],
                    check=False,
                    timeout=30,
                )
                path = found.stdout.strip().splitlines()[-1] if found.stdout.strip() else ""
                version = _version_of(path) if path else None
                if version:
                    return Interpreter(
                        path=Path(path), version=version, found_by="uv python install"
                    )
        except (ToolMissing, proc.CommandFailed):
            pass
    seen = ", ".join(f"{p} ({v})" for p, v in tried.items()) or "none"
    raise ToolMissing(
        f"no Python {minor} on this machine (looked at: {seen}) and uv could not download one. "
        f"Install it (e.g. `pyenv install {minor}`, `apt-get install python{minor}`, or "
        f"`uv python install {minor}` where GitHub is reachable), or change the spec's python.",
        tool=f"python{minor}",
    )
