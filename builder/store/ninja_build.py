"""A ninja build (FlashInfer's) through the store: its key, a stored result placed with
ninja logs for the new env's own commands, and a fresh result kept.

A ninja build checks more than files: it rebuilds an output whose command line differs from
the one in ``.ninja_log`` (the env's path is in every command: flashinfer#4884) or whose
depfile record is missing from ``.ninja_deps``. Placing an entry therefore writes both logs
for the new env's own commands (``ninja -t compdb``), after which ninja has no work to do.
Any mismatch makes ninja rebuild, which is slow but never wrong.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .entries import Entry
from .errors import EntryError
from .hashing import Recorded, env_roots, localise, normalise, tool_identities
from .ninja_files import LOG_HASHES, compdb, ninja_version, read_deps, write_deps, write_log
from .store import Store, note_use


def ninja_material(
    store: Store, build_dir: Path, prefix: str, ninja: str, env: Mapping[str, str]
) -> dict[str, Any]:
    """What a ninja build's key is made of; ``build.ninja`` must be written."""
    return material_of(store, (build_dir / "build.ninja").read_text(), prefix, ninja, env)


def material_of(
    store: Store,
    text: str,
    prefix: str,
    ninja: str,
    env: Mapping[str, str],
    recorded: Recorded | None = None,
) -> dict[str, Any]:
    """What the key of a ninja build described by ``text`` (a ``build.ninja``) is made of.
    ``recorded``: the toolkit's binaries as their wheels' RECORDs state them, for a key that
    only looks up (hashing.recorded_tools); a key that publishes hashes them."""
    variables = dict(
        (line.split("=", 1)[0].strip(), line.split("=", 1)[1].strip())
        for line in text.splitlines()
        if "=" in line and not line.startswith((" ", "\t", "#", "build ", "rule "))
    )
    cuda_home = variables.get("cuda_home", env.get("CUDA_HOME", ""))
    compilers = [c for c in (variables.get("cxx", "c++"), "gcc", "g++") if c]
    return {
        "kind": "ninja",
        "build.ninja": normalise(text, env_roots(prefix)),
        "tools": tool_identities(store.hasher, cuda_home, compilers, env, recorded),
        "ninja": ninja_version(ninja),
    }


def place_ninja(store: Store, key: str, build_dir: Path, prefix: str, ninja: str) -> Entry | None:
    """Put the stored result of ``key`` into ``build_dir`` with ninja logs for this env's own
    commands; the entry placed, or None on a miss (nothing placed then). Every file is
    checked against its record before any is placed: an entry that differs is discarded."""
    entry = store.find(key, prefix)
    if entry is None:
        return None
    header = str(entry.content["ninja_log"])
    edges = compdb(ninja, build_dir)
    roots = env_roots(prefix)
    by_name = {normalise(e["output"], roots): e for e in edges}
    if set(by_name) != set(entry.content["outputs"]):
        return None
    deps = entry.content["deps"]
    latest = 0
    for inputs in deps.values():
        for dep in inputs:
            with contextlib.suppress(OSError):
                latest = max(latest, os.stat(localise(dep, prefix)).st_mtime_ns)
    # Newer than every input, so ninja finds each output up to date.
    stamp = max(latest + 1, time.time_ns())
    # Each output's staged copy, its place, and its edge.
    staged: list[tuple[Path, Path, str, dict[str, str]]] = []
    try:
        for name, edge in by_name.items():
            out = Path(localise(name, prefix))
            if not out.is_absolute():
                out = build_dir / out
            staged.append(
                (store.stage(entry, entry.content["file_of"][name], out), out, name, edge)
            )
    except EntryError as exc:
        for tmp, *_ in staged:
            tmp.unlink(missing_ok=True)
        store.discard(entry.path, str(exc))
        return None
    except BaseException:
        for tmp, *_ in staged:
            tmp.unlink(missing_ok=True)
        raise
    log, records = [], []
    for tmp, out, name, edge in staged:
        os.replace(tmp, out)
        os.utime(out, ns=(stamp, stamp))
        log.append((edge["output"], stamp, edge["command"]))
        if name in deps:
            records.append((edge["output"], stamp, [localise(d, prefix) for d in deps[name]]))
    write_log(build_dir / ".ninja_log", header, log)
    write_deps(build_dir / ".ninja_deps", records)
    note_use(store, entry.path, prefix)
    return entry


def publish_ninja(
    store: Store, key: str, build_dir: Path, prefix: str, ninja: str, meta: Mapping[str, Any]
) -> Path | None:
    """Keep what ninja just built in ``build_dir`` under ``key``. Only a build whose logs
    cudaenv can write again (:data:`LOG_HASHES`, deps format 4) is kept."""
    log = build_dir / ".ninja_log"
    try:
        header = log.read_text().splitlines()[0]
        if header not in LOG_HASHES:
            return None
        recorded = read_deps(build_dir / ".ninja_deps")
    except (OSError, ValueError, IndexError):
        return None
    roots = env_roots(prefix)
    files: dict[str, Path] = {}
    file_of: dict[str, str] = {}
    deps: dict[str, list[str]] = {}
    inputs: list[str] = []
    for edge in compdb(ninja, build_dir):
        name = normalise(edge["output"], roots)
        path = Path(edge["output"])
        path = path if path.is_absolute() else build_dir / path
        if not path.is_file():
            return None
        stored = f"{len(files)}-{path.name}"
        files[stored], file_of[name] = path, stored
        found = recorded.get(edge["output"])
        if found is not None:
            deps[name] = [normalise(d, roots) for d in found[1]]
            inputs += deps[name]
    doc = {
        **meta,
        "kind": "ninja",
        "outputs": sorted(file_of),
        "file_of": file_of,
        "deps": deps,
        "ninja_log": header,
    }
    kept = store.publish(key, files, inputs, doc, prefix)
    if kept is not None:
        note_use(store, kept, prefix)
    return kept
