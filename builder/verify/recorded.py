"""Recorded results: a check whose inputs have not changed since it passed is not run again.

A check that can name everything its verdict depends on (``imports``: the env's installed
distributions, its interpreter, the variables its start-up hook sets, the probe script, the
check's own version) gives :func:`fingerprint` those inputs. A pass is recorded under the
verify work dir (``Target.work``: this user's cache) with the sha256 of those inputs; the
next verify whose inputs hash the same reuses it and says when it was made ("passed 22:47,
env unchanged"). Any change runs the check again; so does ``verify --fresh``. Only a pass is
recorded: a failure is always re-run, so a fix is seen at once.

The record is read under the cache's rules (builder/core/cachefiles.py: no link followed, owner and
modes checked, size bounded) and a record that does not parse is one that is not there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from builder.core import cachefiles, owners
from builder.core.errors import CudaenvError
from builder.core.statuses import FAILED, PASSED
from builder.formats.jsondoc import Reader
from builder.store import env_roots, plans
from builder.verify.model import CheckResult, Target

# Bump when what a record holds, or what a recorded check proves, changes.
# v2: the env's files by their stat (a record without it is not believed).
RECORD_VERSION = 2
# The evidence a reuse adds (verify/__init__.py's borrowers add the second).
REUSE_EVIDENCE = ("recorded", "bytecode")


def fingerprint(inputs: Mapping[str, Any]) -> str:
    """The sha256 of a check's inputs, as canonical JSON."""
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def files_signature(env: Path) -> str | None:
    """The sha256 of every file under the env's ``site-packages`` as git's index keys a file
    (path, inode, size, mtime_ns, ctime_ns), the bytecode the imports write left out: a file
    edited since the pass, even with its size and mtime put back, changes its ctime, and the
    pass is not believed (RECORD lists what the installer wrote, not what is there now). A
    stat a file, ~0.15 s for 20,000 files; None where the env has no site-packages."""
    sites = sorted(env.glob("lib/python3*/site-packages"))
    if not sites:
        return None
    digest = hashlib.sha256()
    for site in sites:
        for dirpath, dirnames, filenames in os.walk(site):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)  # noqa: PTH118 - 20,000 paths: strings
                try:
                    st = os.lstat(full)
                except OSError:
                    continue
                digest.update(
                    f"{full}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n".encode(
                        errors="surrogateescape"
                    )
                )
    return digest.hexdigest()


# A file each env wrote itself (a RECORD, INSTALLER, a .pth) is compared by its bytes, up to
# this much in all: two envs whose files were copied, not linked, are told apart by running
# the check rather than by reading gigabytes.
COMPARED_BYTES = 256 << 20


def same_files(mine: Path, other: Path) -> bool:
    """Whether every file under the two envs' ``site-packages`` is one file (one inode: uv
    links both from its cache) or, for a small file each env wrote itself, the same bytes,
    with no file more on either side (bytecode left out). A pass is taken from another env
    only for this one: its RECORDs being equal says what the installer wrote, not that no
    file was edited since."""
    files: list[dict[str, os.stat_result]] = []
    for env in (mine, other):
        found: dict[str, os.stat_result] = {}
        for site in sorted(env.glob("lib/python3*/site-packages")):
            top = str(site)
            for dirpath, dirnames, filenames in os.walk(top):
                dirnames[:] = [d for d in dirnames if d != "__pycache__"]
                for name in filenames:
                    full = os.path.join(dirpath, name)  # noqa: PTH118
                    with contextlib.suppress(OSError):
                        found[full[len(str(env)) :]] = os.lstat(full)
        files.append(found)
    here, there = files
    roots = (env_roots(str(mine)), env_roots(str(other)))
    if not here or here.keys() != there.keys():
        return False
    budget = COMPARED_BYTES
    for rel, a in here.items():
        b = there[rel]
        if (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino):
            continue
        budget -= a.st_size
        if budget < 0:
            return False
        name = rel.rsplit("/", 1)[-1]
        try:
            with open(f"{mine}{rel}", "rb") as x, open(f"{other}{rel}", "rb") as y:  # noqa: PTH123
                # Each env's own path written @ENV@ (its start-up hook, a RECORD's lines for
                # its console scripts): what the file holds wherever the env lies.
                ours = plans.placeless(name, x.read(a.st_size + 1), roots[0])
                theirs = plans.placeless(name, y.read(b.st_size + 1), roots[1])
        except OSError:
            return False
        if ours != theirs:
            return False
    return True


def path_of(target: Target, name: str) -> Path:
    return target.work / "results" / f"{name}.json"


def _read_pass(
    path: Path, name: str, inputs: str
) -> tuple[CheckResult, str, dict[str, Any]] | None:
    """The pass recorded at ``path`` for ``name`` under ``inputs``: (its result, when it was
    made as the user reads it, the record); None where there is none."""
    doc = cachefiles.read_json(path)
    if not isinstance(doc, dict) or doc.get("version") != RECORD_VERSION:
        return None
    if doc.get("inputs") != inputs or not isinstance(doc.get("at"), str):
        return None
    try:
        result = CheckResult.from_json(Reader(doc.get("result"), str(path), "recorded result"))
        at = dt.datetime.fromisoformat(str(doc["at"]))
    except (CudaenvError, ValueError):
        return None
    if result.status != PASSED or result.name != name:
        return None
    # What the run that made the record said of its own reuse is not this run's evidence.
    kept = tuple(e for e in result.evidence if e[0] not in REUSE_EVIDENCE)
    result = dataclasses.replace(result, evidence=kept)
    return result, at.astimezone().strftime("%H:%M" if _today(at) else "%Y-%m-%d %H:%M"), doc


def recorded(target: Target, name: str, inputs: str) -> CheckResult | None:
    """The pass recorded for ``name`` under the same inputs, said as reused; None otherwise."""
    found = None if target.fresh else _read_pass(path_of(target, name), name, inputs)
    if found is None:
        return None
    result, when, doc = found
    if doc.get("files") != files_signature(env_root(target)):
        return None  # a file changed since the pass (its RECORD may say nothing of it)
    return CheckResult(
        name=name,
        status=PASSED,
        summary=f"passed {when}, env unchanged: {result.summary}",
        evidence=(
            *result.evidence,
            ("recorded", f"{doc['at']} (inputs sha256 {inputs[:16]}; `verify --fresh` runs it)"),
        ),
        fix=result.fix,
        warnings=result.warnings,
    )


def _today(at: dt.datetime) -> bool:
    return at.astimezone().date() == dt.datetime.now().astimezone().date()


def shared_path(name: str, inputs: str) -> Path:
    """Where a pass is kept for every env of this user with the same inputs: a check whose
    inputs name nothing of where the env lies (``imports``) holds for an identical env."""
    return cachefiles.cache_dir() / "verify" / "passed" / f"{name}-{inputs[:32]}.json"


def env_root(target: Target) -> Path:
    return target.python.absolute().parent.parent


def twin_path(target: Target, name: str) -> Path | None:
    """Where the last result of ``name`` in an env of this env's signature is noted
    (builder/store/plans.py: its RECORDs, hook and interpreter, not its path); None for an
    interpreter whose env cudaenv cannot read. Read before any probe, so that verify of a
    second identical env probes once."""
    from builder.store import Hasher, plans

    sig = plans.signature(env_root(target), Hasher(None))
    if sig is None:
        return None
    return cachefiles.cache_dir() / "verify" / "passed" / f"{name}-env-{sig[:32]}.json"


def record(
    target: Target, name: str, inputs: str, result: CheckResult, *, shared: bool = True
) -> None:
    """Keep a pass for the next verify, of this env and (``shared``: it ran here) of an
    identical one; nothing else is kept (and a record that cannot be written costs the next
    verify a run, never this one). A pass reused from another env keeps naming that env."""
    twin = twin_path(target, name)
    failed = failed_path(target, name)
    if result.status != PASSED:
        # The record says the last run passed (:func:`passed_last`): not any more, here or
        # for an env identical to this one.
        for path in (path_of(target, name), shared_path(name, inputs), twin):
            if path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()
        if result.status == FAILED:
            cachefiles.write_text(failed, f"{result.summary[:300]}\n")
        return
    with contextlib.suppress(OSError):
        failed.unlink()
    doc = {
        "version": RECORD_VERSION,
        "inputs": inputs,
        "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "result": result.to_json(),
        "env": str(env_root(target)),
        "files": files_signature(env_root(target)),
    }
    cachefiles.write_json(path_of(target, name), doc)
    if shared:
        cachefiles.write_json(shared_path(name, inputs), doc)
    if twin is not None:
        cachefiles.write_json(twin, {"version": RECORD_VERSION, "inputs": inputs})


def note_twin(target: Target, name: str, inputs: str) -> None:
    """Note a reused pass for envs of this env's signature too (:func:`passed_last`), where
    the note is missing: an env verified before the note existed names it from now on."""
    twin = twin_path(target, name)
    if twin is not None and cachefiles.read_json(twin) is None:
        cachefiles.write_json(twin, {"version": RECORD_VERSION, "inputs": inputs})


def borrowed(target: Target, name: str, inputs: str) -> tuple[CheckResult, Path] | None:
    """The pass an identical env (another path, the same inputs) recorded for ``name``, said
    as made there, and that env; None where there is none."""
    found = None if target.fresh else _read_pass(shared_path(name, inputs), name, inputs)
    if found is None:
        return None
    result, when, doc = found
    other = doc.get("env")
    if not isinstance(other, str) or Path(other) == env_root(target):
        return None
    if not any(Path(other).glob("lib/python3*/site-packages")):
        return None  # gone: the check runs here, and this env is the one named next time
    if doc.get("files") != files_signature(Path(other)):
        return None  # that env changed since its pass: it vouches for nothing now
    if not same_files(env_root(target), Path(other)):
        return None  # not the same files here, whatever the RECORDs say
    if owners.tree_why(Path(other)) is not None or owners.env_why(Path(other)) is not None:
        # Another user owns or can write that env (or a directory above it): neither its
        # pass nor its bytecode is taken; the check runs here.
        return None
    said = CheckResult(
        name=name,
        status=PASSED,
        summary=f"passed {when} in {other}, an identical env: {result.summary}",
        evidence=(
            *result.evidence,
            (
                "recorded",
                f"{doc['at']} in {other}: every RECORD, .pth file, the start-up hook, the "
                f"interpreter and the variables as here (inputs sha256 {inputs[:16]}; "
                "`verify --fresh` runs it)",
            ),
        ),
        fix=result.fix,
        warnings=result.warnings,
    )
    return said, Path(other)


def failed_path(target: Target, name: str) -> Path:
    return target.work / "results" / f"{name}.failed"


def failed_last(target: Target, name: str) -> bool:
    """Whether the last run of ``name`` for this target failed (one never run here did not):
    verify then lets the compiles wait for it, as a failure is likely again and the compiles
    cost minutes."""
    return not target.fresh and failed_path(target, name).is_file()


def passed_last(target: Target, name: str) -> bool:
    """Whether the last run of ``name`` for this target passed (a failure removes the
    record), whatever its inputs were then: verify then starts FlashInfer's JIT in its first
    probe, paying torch's import once, where a failing env would be probed twice."""
    if target.fresh:
        return False
    doc = cachefiles.read_json(path_of(target, name))
    if not isinstance(doc, dict) or doc.get("version") != RECORD_VERSION:
        # Never verified here: an env of the same signature passed it (a second env of one
        # lock and spec), and its pass is still on record.
        twin = twin_path(target, name)
        note = cachefiles.read_json(twin) if twin is not None else None
        inputs = note.get("inputs") if isinstance(note, dict) else None
        if not isinstance(inputs, str):
            return False
        doc = cachefiles.read_json(shared_path(name, inputs))
        if not isinstance(doc, dict) or doc.get("version") != RECORD_VERSION:
            return False
    result = doc.get("result")
    return isinstance(result, dict) and result.get("status") == PASSED
