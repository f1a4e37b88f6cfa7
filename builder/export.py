"""Lock -> wheelhouse: every locked file downloaded and hash-checked, for air-gapped boxes.

`cudaenv export SPEC --wheelhouse DIR` here, carry DIR over, then
`cudaenv build SPEC --offline --wheelhouse DIR` there: uv installs from DIR alone
(`--no-index --find-links DIR --offline`), still requiring every hash of the lock.
pip downloads (uv has no download command), run by the spec's own Python so environment
markers are evaluated for it; pip uses the machine's index configuration.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from builder import interpreters, proc
from builder.errors import BuildError, ToolMissing
from builder.lock import Lock
from builder.spec import EnvSpec

MANIFEST = "cudaenv-export.json"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_wheelhouse(lock: Lock, wheelhouse: Path) -> dict[str, str]:
    """name -> file for every locked package; raises naming what is missing or tampered."""
    by_hash: dict[str, Path] = {}
    for path in wheelhouse.iterdir():
        if path.is_file() and path.name.endswith((".whl", ".tar.gz", ".zip")):
            by_hash[sha256_of(path)] = path
    files: dict[str, str] = {}
    missing = []
    for pkg in lock.packages:
        found = next((by_hash[h] for h in pkg.hashes if h in by_hash), None)
        if found is None:
            missing.append(f"{pkg.name}=={pkg.version}")
        else:
            files[pkg.name] = found.name
    if missing:
        raise BuildError(
            f"{wheelhouse}: no file with a locked hash for {len(missing)} package(s): "
            f"{', '.join(missing[:10])}; re-run `cudaenv export`"
        )
    return files


def export(spec: EnvSpec, lock: Lock, wheelhouse: Path, progress: Callable[[str], None]) -> Path:
    interp = interpreters.find(spec.python, allow_download=False)
    wheelhouse.mkdir(parents=True, exist_ok=True)
    req = wheelhouse / f".requirements.{os.getpid()}.txt"
    req.write_text(lock.requirements_txt())
    progress(
        f"downloading {len(lock.packages)} locked files into {wheelhouse} with {interp.path} -m pip"
    )
    try:
        proc.run(
            [interp.path, "-m", "pip", "download", "--no-deps", "--require-hashes",
             "--disable-pip-version-check", "--progress-bar", "off", "-d", wheelhouse, "-r", req],
            stream=True,
            timeout=7200,
        )  # fmt: skip
    except proc.CommandFailed as exc:
        if "No module named pip" in exc.output:
            raise ToolMissing(
                f"{interp.path} has no pip; add it with `{interp.path} -m ensurepip`"
            ) from exc
        raise BuildError(
            f"{spec.name}: downloading the lock failed:\n{exc.output[-3000:]}"
        ) from exc
    finally:
        req.unlink(missing_ok=True)
    files = check_wheelhouse(lock, wheelhouse)
    doc = {"spec": spec.name, "lock_hash": lock.content_hash(), "files": files}
    return proc.atomic_write_text(
        wheelhouse / MANIFEST, json.dumps(doc, indent=2, sort_keys=True) + "\n"
    )
