"""An edit of a spec and its lock that a command makes in steps (`cudaenv add`: the spec, then
its lock, then the env), journaled so that the three change together or not at all.

A command that handles its own failure puts the spec and the lock back itself. One that is
killed (SIGKILL, a lost machine) cannot: the journal beside the spec
(``.NAME.yaml.edit.json``: the process, the spec's and the lock's bytes as they were, the
edited spec's sha256) is read by the next command that loads the spec
(:func:`settle`): while its process lives it is left alone; once it is gone, an env already
built from the edited spec and its lock keeps the edit, and anything else gets the spec and
the lock back as they were, said in one line.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from builder.core import proc
from builder.core.errors import CudaenvError
from builder.env import manifest
from builder.spec import envspec, lock

VERSION = 1


def journal_path(spec_file: Path) -> Path:
    return spec_file.parent / f".{spec_file.name}.edit.json"


def begin(spec_file: Path, original: bytes, edited: str, lock_file: Path) -> Path:
    """Journal an edit of ``spec_file`` (now ``original``, to become ``edited``) and of its lock
    at ``lock_file``, before either changes; the journal's path."""
    old_lock = lock_file.read_bytes() if lock_file.is_file() else None
    doc = {
        "version": VERSION,
        "pid": os.getpid(),
        "spec": base64.b64encode(original).decode(),
        "lock_file": str(lock_file.absolute()),
        "lock": None if old_lock is None else base64.b64encode(old_lock).decode(),
        "edited_sha256": hashlib.sha256(edited.encode()).hexdigest(),
    }
    return proc.atomic_write_text(journal_path(spec_file), json.dumps(doc))


def end(journal: Path) -> None:
    """The edit is settled (done, or put back by its own command): the journal goes."""
    journal.unlink(missing_ok=True)


def put_back(spec_file: Path, journal: Path) -> Path:
    """The spec and the lock as the journal says they were; the lock's path."""
    doc = _read(journal)
    if doc is None:
        raise ValueError(f"{journal}: not a journal of an edit")
    proc.atomic_write_text(spec_file, base64.b64decode(doc["spec"]).decode())
    lock_file = Path(doc["lock_file"])
    if doc["lock"] is None:
        lock_file.unlink(missing_ok=True)
    else:
        proc.atomic_write_text(lock_file, base64.b64decode(doc["lock"]).decode())
    end(journal)
    return lock_file


def settle(spec_file: Path, env_of: Callable[[], Path | None], say: Callable[[str], None]) -> None:
    """Finish what an interrupted edit of ``spec_file`` left (see the module): nothing where
    no journal is there or its process still runs. ``env_of``: the env the spec builds (its
    manifest says which spec fingerprint and lock it was built from)."""
    journal = journal_path(spec_file)
    doc = _read(journal)
    if doc is None or _alive(doc["pid"]):
        return
    try:
        edited_now = hashlib.sha256(spec_file.read_bytes()).hexdigest() == doc["edited_sha256"]
    except OSError:
        edited_now = False
    if edited_now and _built_from_it(env_of(), spec_file, Path(doc["lock_file"])):
        end(journal)  # killed after the env was swapped in: the edit is whole
        return
    lock_file = put_back(spec_file, journal)
    say(
        f"an interrupted edit (process {doc['pid']}, `cudaenv add`) had changed {spec_file} "
        f"and {lock_file} but not the env: both are as they were before it"
    )


def _built_from_it(env: Path | None, spec_file: Path, lock_file: Path) -> bool:
    """Whether ``env`` was built from the spec now at ``spec_file`` and the lock now at
    ``lock_file`` (its manifest's spec fingerprint and lock hash)."""
    if env is None:
        return False
    found = manifest.try_read(env)
    if found is None:
        return False
    try:
        built = envspec.load(spec_file).fingerprint() == found.fingerprint
        return built and lock.read(lock_file).content_hash() == found.lock_hash
    except (CudaenvError, OSError):  # an unreadable spec or lock is not the env's
        return False


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process of that number: not ours to judge
    return True


def _read(journal: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        if journal.is_file() and not journal.is_symlink():
            doc = json.loads(journal.read_text())
            if isinstance(doc, dict) and doc.get("version") == VERSION:
                return doc
    return None
