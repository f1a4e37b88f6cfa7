"""Run INSIDE a target interpreter by verify's ``imports`` check; standard library only.

Argument: a JSON object ``{"distributions": [[NAME, REQUIRED], ...], "modules": {NAME:
[MODULE, ...]}}``: the distributions the spec asks for, and the modules a server of each
imports at start-up besides its top-level package. Each distribution's import names come
from its own metadata (top_level.txt, else its RECORD). Every module is imported in turn in
this one process (torch, imported by most, is paid once), and one JSON line per event goes
to the real stdout: ``{"dist": ...}`` per distribution, ``{"start": MODULE}`` before an
import (so a run killed at its timeout still says which import hung), ``{"module": ...}``
after it. What the imported packages print goes to stderr.

A ModuleNotFoundError names the missing module, the installed distributions that provide it
(none: it is simply not installed), and who imported it: the last frame of the traceback
that is a file, mapped to its distribution through the RECORDs, and whether that
distribution declares a requirement of the module's name.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import re
import sys
import time
import traceback
from typing import Any, TextIO

# Top-level names a distribution may ship that no server imports.
NOT_IMPORTED = frozenset(("test", "tests", "testing", "docs", "examples", "benchmarks", "scripts"))
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def top_levels(dist: Any) -> list[str]:
    """The import names a distribution installs."""
    text = dist.read_text("top_level.txt")
    if text:
        names = [n.strip() for n in text.splitlines() if n.strip()]
    else:
        names = []
        for f in dist.files or []:
            parts = f.parts
            if not parts or parts[0].startswith("..") or parts[0] == "__pycache__":
                continue
            if parts[0].endswith((".dist-info", ".data", ".egg-info")):
                continue
            if len(parts) == 1:
                if parts[0].endswith(".py") or parts[0].endswith(".so"):
                    names.append(parts[0].split(".")[0])
            else:
                names.append(parts[0])
    return sorted({n.replace("/", ".") for n in names if _IDENT.match(n.split(".")[0])})


def import_names(name: str, dist: Any) -> list[str]:
    """What `import` a user writes for this distribution: its own name where it installs a
    package of that name, else every public top-level name."""
    names = top_levels(dist)
    own = normalize(name).replace("-", "_")
    if own in names:
        return [own]
    return [n for n in names if not n.startswith("_") and n not in NOT_IMPORTED]


_OWNERS: dict[str, tuple[str, str]] | None = None


def owner_of(path: str) -> tuple[str, str] | None:
    """(distribution, version) whose RECORD lists ``path``; read only after a failure."""
    global _OWNERS
    if _OWNERS is None:
        _OWNERS = {}
        for dist in md.distributions():
            for f in dist.files or []:
                where = os.path.normpath(str(dist.locate_file(f)))
                _OWNERS.setdefault(where, (dist.metadata["Name"], dist.version))
    return _OWNERS.get(os.path.normpath(path))


def providers(top: str) -> list[str]:
    found = []
    for dist in md.distributions():
        if top in safe_top_levels(dist):
            found.append("%s %s" % (dist.metadata["Name"], dist.version))
    return sorted(set(found))


def safe_top_levels(dist: Any) -> list[str]:
    try:
        return top_levels(dist)
    except Exception:  # a broken metadata directory is not this import's answer
        return []


def declares(dist_name: str, module: str) -> Any:
    """How ``dist_name`` requires a distribution named like ``module``: True (always), the
    name of the extra it is required under (sglang 0.5.2 asks pybase64 only with its
    ``runtime-common`` extra, yet imports it unconditionally), or False."""
    try:
        requires = md.distribution(dist_name).requires or []
    except md.PackageNotFoundError:
        return False
    wanted = normalize(module)
    extras = []
    for req in requires:
        m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
        if m and normalize(m.group(1)) == wanted:
            extra = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", req)
            if extra is None:
                return True
            extras.append(extra.group(1))
    return extras[0] if extras else False


def importer(exc: BaseException) -> dict[str, Any] | None:
    """The file whose import statement failed: the traceback's last frame that is a file
    (the import system's own frames are ``<frozen ...>``)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    if not frames:
        return None
    last = frames[-1]
    out: dict[str, Any] = {"file": last.filename, "line": last.lineno}
    owner = owner_of(last.filename)
    if owner is not None:
        out["dist"], out["version"] = owner
    return out


def attempt(module: str) -> dict[str, Any]:
    started = time.monotonic()
    out: dict[str, Any] = {"module": module}
    try:
        importlib.import_module(module)
        out["ok"] = True
    except (Exception, SystemExit) as exc:
        out["ok"] = False
        first = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
        out["error"] = ("%s: %s" % (type(exc).__name__, first))[:500]
        try:
            where = importer(exc)
            if where is not None:
                out["importer"] = where
            if isinstance(exc, ModuleNotFoundError) and exc.name:
                top = exc.name.split(".")[0]
                out["missing"] = exc.name
                out["providers"] = providers(top)
                if where is not None and "dist" in where:
                    where["declares"] = declares(where["dist"], top)
        except Exception as inner:  # the diagnosis must not hide the verdict
            out["diagnosis_error"] = "%s: %s" % (type(inner).__name__, inner)
    out["seconds"] = round(time.monotonic() - started, 3)
    return out


def emit(out: TextIO, doc: dict[str, Any]) -> None:
    out.write(json.dumps(doc) + "\n")
    out.flush()


def main() -> int:
    request = json.loads(sys.argv[1])
    # Our lines on the real stdout; whatever the imported packages print (C code included)
    # goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    extra: dict[str, list[str]] = request.get("modules") or {}
    modules: list[str] = []
    for name, required in request["distributions"]:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            emit(out, {"dist": name, "installed": False, "required": bool(required)})
            continue
        names = import_names(name, dist)
        emit(out, {"dist": name, "installed": True, "version": dist.version, "imports": names})
        for module in names + list(extra.get(name, [])):
            if module not in modules:
                modules.append(module)
    for module in modules:
        emit(out, {"start": module})
        emit(out, attempt(module))
    emit(out, {"bytecode": keep_bytecode()})
    emit(out, {"done": True})
    return 0


def keep_bytecode() -> dict[str, Any]:
    """The bytecode of every module this process imported from the env (sys.prefix), written
    where it is missing or stale, so that a server's first start of this env imports from
    bytecode: ``uv pip sync`` compiles none, and PYTHONDONTWRITEBYTECODE (set in many
    images) keeps the imports above from writing any. Only what was imported: the whole env
    is tens of thousands of files. A file the process cannot write (an env of another user)
    is counted, never fatal."""
    import importlib.util
    import py_compile

    started = time.monotonic()
    prefix = os.path.realpath(sys.prefix) + os.sep
    counts = {"written": 0, "present": 0, "failed": 0}
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if not isinstance(source, str) or not source.endswith(".py"):
            continue
        source = os.path.realpath(source)
        if not source.startswith(prefix):
            continue
        try:
            cached = importlib.util.cache_from_source(source)
            if os.path.exists(cached) and os.stat(cached).st_mtime >= os.stat(source).st_mtime:
                counts["present"] += 1
                continue
            py_compile.compile(source, cfile=cached, doraise=True)
            counts["written"] += 1
        except (OSError, py_compile.PyCompileError, ValueError):
            counts["failed"] += 1
    return {**counts, "seconds": round(time.monotonic() - started, 3)}


if __name__ == "__main__":
    sys.exit(main())
