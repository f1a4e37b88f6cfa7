"""The envs built here: ``cudaenv list``, ``remove`` and ``run``.

An env is a directory in the project's envs dir (``.envs/`` at the project root,
``paths.envs_dir``) with a manifest (``cudaenv.json``) cudaenv can read; matrix cells live
under ``.envs/.matrix/`` and are the matrix's own, so they are not listed. ``remove`` and
``run`` take env names only, never paths: a directory elsewhere that happens to hold a
``cudaenv.json`` is not cudaenv's to delete or run.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from builder.core import proc, settings
from builder.core.errors import CudaenvError, ReportError, SpecError, UsageError
from builder.core.paths import envs_dir, project_root
from builder.env import manifest
from builder.spec import lock


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
            "name": json_text(self.name),
            "path": json_text(str(self.path)),
            "spec": json_text(self.spec),
            "lock": self.lock_state,
            "bytes": self.bytes_total,
            "bytes_not_shared": self.bytes_own,
            "last_verify": self.verified,
            "platform": self.platform,
        }

    def line(self) -> str:
        """The env in `cudaenv list`. Names and specs come from the file system and the
        manifests: escaped, so none can forge a line or send the terminal a control sequence."""
        size = f"{human(self.bytes_total)} ({human(self.bytes_own)} not shared)"
        return (
            f"{shown(self.name)}  spec {shown(self.spec)}  lock {self.lock_state}  {size}  "
            f"last verify {self.verified or 'never'}"
            + (f"  [{shown(self.platform)}]" if self.platform else "")
        )


def shown(text: str) -> str:
    """``text`` safe to print on a terminal: as it is where every character is printable and
    no space, else in single quotes with each other character escaped as Python writes it
    (``'a\\nb'``) and each byte that is not UTF-8 as ``\\xNN``, as ``ls`` quotes a name. A
    directory name holding a newline cannot forge a line of ``cudaenv list``."""
    if text and all(c.isprintable() and not c.isspace() and c not in "'\\" for c in text):
        return text
    out = []
    for c in text:
        if "\udc80" <= c <= "\udcff":  # a byte that is not UTF-8 (os.fsdecode's surrogateescape)
            out.append(f"\\x{ord(c) - 0xDC00:02x}")
        elif c in "'\\":
            out.append("\\" + c)
        elif c.isprintable():
            out.append(c)
        else:
            out.append(repr(c)[1:-1])  # \n, \t, \x1b, \u202e, ...
    return "'" + "".join(out) + "'"


def json_text(text: str) -> str:
    """``text`` as valid JSON text: each byte that is not UTF-8 (a lone surrogate once decoded,
    which strict JSON readers refuse) becomes the four characters ``\\xNN``, as Python's
    ``backslashreplace`` writes it; everything else is kept."""
    return _SURROGATE.sub(_escaped, text)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _escaped(found: re.Match[str]) -> str:
    c = found[0]
    return f"\\x{ord(c) - 0xDC00:02x}" if "\udc80" <= c <= "\udcff" else f"\\u{ord(c):04x}"


def _one_line(text: str) -> str:
    # A message quoting a file's content (a manifest's error) must stay one printable line.
    first = text.splitlines()[0] if text else ""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in first)


def _is_name(name: str) -> bool:
    # A name is one path component that is not cudaenv's own (.NAME.lock, .matrix/, ...).
    return bool(name) and "/" not in name and "\0" not in name and not name.startswith(".")


def resolve(name: str) -> Path:
    """The env called ``name`` in the project's envs dir (a link there is taken as it is,
    never resolved to where it points); UsageError (one line) for anything else: a path, a
    hidden name, no such env, a directory whose manifest is not cudaenv's."""
    root = envs_dir()
    if not _is_name(name):
        raise UsageError(
            f"{shown(name)}: not an env name; `cudaenv remove` and `run` take the name of an "
            f"env in {shown(str(root))} (`cudaenv list`), not a path"
        )
    path = root / name
    if not path.is_dir():
        built = ", ".join(shown(e.name) for e in _dirs()) or "none"
        raise UsageError(
            f"{shown(name)}: no env of that name in {shown(str(root))} (built here: {built})"
        )
    try:
        manifest.read(path)
    except ReportError as exc:
        raise UsageError(
            f"{shown(name)}: {shown(str(path))} is not an env cudaenv built ({_one_line(str(exc))})"
        ) from None
    return path


def runnable(name: str) -> Path:
    """The env called ``name`` (:func:`resolve`) that ``run`` may start: one whose directory
    lies in the envs dir. A ``.envs/NAME`` link to a directory elsewhere (a checkout can carry
    one) would run an interpreter nobody built here; UsageError (one line) names where it
    points."""
    path = resolve(name)
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(path.parent.resolve()):
            raise UsageError(
                f"{shown(name)}: {shown(str(path))} is a link to {shown(str(target))}, outside "
                f"{shown(str(path.parent))}: `cudaenv run` starts only envs that are there "
                f"(run {shown(str(target / 'bin' / 'python'))} yourself if you trust it)"
            )
    return path


def _dirs() -> list[Path]:
    root = envs_dir()
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _is_name(p.name) and manifest.exists(p))


def names() -> list[str]:
    """The envs' names a shell can complete: those printed as they are (``shown``)."""
    return [p.name for p in _dirs() if shown(p.name) == p.name]


def where() -> str:
    """One line: which envs dir ``list`` read, and why there (the project root found)."""
    root = project_root()
    if root is None:
        return (
            f"# envs in {shown(str(envs_dir()))} (no project root at or above the current "
            "directory: no envspecs/ or pyproject.toml with [tool.cudaenv])"
        )
    return f"# envs in {shown(str(envs_dir()))} (project root {shown(str(root))})"


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
    from builder.spec import envspec as spec_mod

    if found.spec == manifest.ADOPTED_SPEC:
        return found.spec
    # The spec as the build was given it: relative to where the build ran, the project root
    # as a rule (the envs dir's parent), else perhaps here.
    given = Path(found.spec)
    candidates = [given] if given.is_absolute() else [envs_dir().parent / given, given]
    source = next((c for c in candidates if c.is_file()), None)
    if source is None:
        return "no spec file"
    try:
        s = spec_mod.load(source)
    except SpecError:
        return f"spec {source} does not load"
    if s.fingerprint() != found.fingerprint:
        return f"stale: {source} changed since the build"
    path = lock.lock_path(s.source, s.name)
    try:
        lk = lock.read(path, spec=s)
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


def _leftover(name: str) -> re.Pattern[str]:
    # What build.py leaves of env NAME when killed (.NAME.old-PID, .NAME.tmp-PID-XXXXXXXX),
    # matched whole: env "a" must not take env "a.old-1"'s files for its own.
    return re.compile(rf"\.{re.escape(name)}\.(old-[0-9]+|tmp-[0-9]+-[A-Za-z0-9_]+)")


def remove(path: Path) -> str:
    """Delete the env at ``path`` (from :func:`resolve`) whole, waiting for a build of it to
    finish first, with what killed builds of it left and its lock file; returns what was done.

    A directory is renamed aside before deletion, so an interrupted remove leaves no half env.
    A link is removed, never what it points to: the target is outside the envs dir (another
    project's env, a shared disk) and was not made by this project's build; ``rm`` of a link
    does the same."""
    from builder.env import place

    flock_path = path.with_name(f".{path.name}.lock")
    with place.env_lock(path, lambda _msg: None):
        if path.is_symlink():
            target = shown(str(path.readlink()))
            done = f"removed the link {shown(str(path))} (what it points to, {target}, is left)"
            path.unlink()
        elif path.is_dir():
            aside = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.rename(path, aside)
            proc.delete(aside)
            done = f"removed {shown(str(path))}"
        else:  # another remove got here first, while this one waited for the lock
            done = f"{shown(str(path))} was removed already"
        pattern = _leftover(path.name)
        for entry in path.parent.iterdir():
            if pattern.fullmatch(entry.name):
                proc.delete(entry)
        # Unlinked while still held: place.env_lock takes the lock again on the file now at
        # the path when the one it waited on was deleted.
        flock_path.unlink(missing_ok=True)
    return done


def human(n: int) -> str:
    """A size in bytes as people read it: ``512 B``, ``1.5 KiB`` ... ``2.0 TiB``."""
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


# What `run` starts in the env's interpreter (after its start-up hook has run): it becomes the
# command, or says why it cannot, as a shell does (127 not found, 126 found but not runnable:
# not executable, a directory, ...), instead of a FileNotFoundError traceback.
TRAMPOLINE = """\
import os, sys
try:
    os.execvp(sys.argv[1], sys.argv[1:])
except OSError as exc:
    cmd = sys.argv[1] if sys.argv[1].isprintable() else repr(sys.argv[1])
    missing = isinstance(exc, FileNotFoundError)
    why = "command not found" if missing and "/" not in cmd else exc.strerror
    sys.stderr.write("error: %s: %s\\n" % (cmd, why))
    sys.exit(127 if missing else 126)
"""


def run(name: str, command: Sequence[str]) -> NoReturn:
    """`cudaenv run NAME -- CMD ARGS...`: replace this process with CMD in the env called
    ``name`` (:func:`runnable`), with the env's bin/ first on PATH; UsageError (one line)
    where there is no command or the env has no interpreter to start."""
    path = runnable(name)
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("run needs a command: `cudaenv run NAME -- CMD ARGS...`")
    python = path / "bin" / "python"
    if not python.exists():
        raise UsageError(f"{shown(str(path))} has no bin/python (assembled for another platform?)")
    env = settings.child_environ(VIRTUAL_ENV=str(path), PYTHONHOME=None)
    env["PATH"] = f"{path / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # The env's interpreter starts (its start-up hook sets CUDA_HOME, the arch lists, the
    # caches, ...) and replaces itself with the command, which inherits exactly that.
    proc.replace_process([str(python), "-c", TRAMPOLINE, *argv], env)
