"""Placement plans: what a prefetch needs to place a stored module into an env, kept per env
signature so that the next env of the same signature is served without FlashInfer.

Placing a FlashInfer module needs what FlashInfer writes before it compiles (``build.ninja``,
the sources it generates into its workspace) and the key computed from them: generating them
means importing FlashInfer in the env, seconds a build would pay on every run. The first
prefetch or warm in an env does that once; what it found is kept here, for the env's
*signature*: every installed distribution's RECORD (each file's sha256, as installers write
it), its ``.pth`` files, cudaenv's start-up hook (the variables FlashInfer reads: the arch
list, its threads, the JIT workspace), the interpreter and the machine. Two envs of one lock
and one spec have one signature wherever they live, so FlashInfer would write the same files
in both (the env's path written as ``@ENV@``).

A plan is a hint, never a proof. A planned module is placed only when the key computed here
from the planned ``build.ninja`` and this machine's tools is the one planned, the store holds
an entry under it whose every input has the same content here, and ``ninja -n`` then finds
nothing to do. Anything else removes what was written and leaves the module to the probe, which
generates it in the env as before. A plan is read under the store's rules (no link followed,
nothing another user could write, size bounded), and every path in it stays inside the env's
JIT workspace (``var/``).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import EntryError, StoreError
from .hashing import ENV, Hasher, Recorded, env_roots, key_of, localise, normalise
from .ninja_build import material_of, place_ninja
from .ninja_files import compdb, read_deps
from .store import Store
from .trust import check_dir, open_regular, read_doc, tmp_tag

# Bump when what a plan holds, or what a signature covers, changes.
PLAN_VERSION = 1
# Where a planned file may be: the env's JIT workspace, where no wheel installs anything and
# FlashInfer writes what it generates (the hook's FLASHINFER_WORKSPACE_BASE).
WORKSPACE = f"{ENV}/var/"
# A generated source, a build.ninja or an embedded cubin: one larger is not planned, and a
# module whose files add up to more is left to the probe (a plan is one JSON document).
MAX_PLANNED_FILE = 4 << 20
MAX_PLANNED_MODULE = 8 << 20
# The most a RECORD is read for the signature (torch's is about 2 MiB).
MAX_RECORD = 32 << 20
# cudaenv's start-up hook: its first line names the env, the rest is the same for every env
# of one spec.
HOOK = "_cudaenv_hook.py"
NINJA_TIMEOUT = 60.0


def _bounded(path: Path, limit: int) -> bytes:
    """A regular file's bytes (no link followed), at most ``limit``."""
    fd, _ = open_regular(path, trusted=False)
    with os.fdopen(fd, "rb") as fh:
        return fh.read(limit)


def placeless(name: str, data: bytes, roots: list[str]) -> bytes:
    """What the site-packages entry ``name`` holds that does not depend on where the env
    lies: a RECORD without its lines for files outside site-packages (a console script holds
    the env's path in its first line, so its RECORD line does too), the start-up hook without
    its first line (it names the env), any other text with the env's path written ``@ENV@``.
    The env signature here and the imports check's recorded inputs are made of it."""
    if name == "RECORD":
        if b"\n../" in data or data.startswith(b"../"):
            data = b"\n".join(ln for ln in data.split(b"\n") if not ln.startswith(b"../"))
        return data
    if name == HOOK:
        data = data.partition(b"\n")[2]
    return normalise_bytes(data, roots)


def signature(prefix: Path, hasher: Hasher) -> str | None:
    """The env's signature (see the module's docstring); None for a tree that is not a venv
    cudaenv can read (no plan is used for it then)."""
    roots = env_roots(str(prefix))
    sites = sorted(prefix.glob("lib/python3*/site-packages"))
    if not sites:
        return None
    parts: dict[str, Any] = {"plan": PLAN_VERSION, "machine": platform.machine()}
    try:
        for site in sites:
            listed: dict[str, str] = {}
            for name in sorted(os.listdir(site)):
                if name == "__pycache__":
                    continue  # bytecode, which an env gains as it is used
                path = site / name
                if name.endswith(".dist-info"):
                    data = placeless("RECORD", _bounded(path / "RECORD", MAX_RECORD), roots)
                    listed[name] = hashlib.sha256(data).hexdigest()
                elif name.endswith(".pth") or name == HOOK:
                    data = placeless(name, _bounded(path, MAX_RECORD), roots)
                    listed[name] = hashlib.sha256(data).hexdigest()
                else:
                    listed[name] = ""
            parts[str(site.relative_to(prefix))] = listed
    except (OSError, EntryError):
        return None
    python = os.path.realpath(prefix / "bin" / "python")
    parts["python"] = [python, hasher.sha256(python)]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def plan_path(store: Store, sig: str) -> Path:
    return store.root / "plans" / f"{sig}.json"


def read_plan(store: Store, sig: str) -> dict[str, dict[str, Any]]:
    """The modules planned for ``sig`` (by recipe, as canonical JSON); none where the plan is
    missing, unreadable, not of its kind or in a tree another user could write."""
    path = plan_path(store, sig)
    try:
        check_dir(path.parent)
        doc = read_doc(path, trusted=True)
    except (StoreError, EntryError, OSError):
        return {}
    return parse_plan(doc, sig)


def parse_plan(doc: Any, sig: str) -> dict[str, dict[str, Any]]:
    """The modules of the plan document ``doc`` for ``sig`` that are of a plan's form (each
    path inside the env's JIT workspace); none for a document of another kind or signature."""
    if not (isinstance(doc, dict) and doc.get("version") == PLAN_VERSION):
        return {}
    if doc.get("signature") != sig or not isinstance(doc.get("modules"), dict):
        return {}
    return {k: v for k, v in doc["modules"].items() if isinstance(k, str) and _is_item(v)}


def plan_doc(sig: str, modules: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """The plan document of ``modules`` for ``sig``, as the store keeps it."""
    return {"version": PLAN_VERSION, "signature": sig, "modules": dict(modules)}


def vouched(
    store: Store, modules: Mapping[str, dict[str, Any]], prefix: str
) -> dict[str, dict[str, Any]]:
    """The modules of a plan from elsewhere (a registry) that this store vouches for, file by
    file: ``build.ninja`` by the module's key (placing computes the key from it and places
    only under an equal one), every other file by an input with the same content recorded
    by an entry the store holds under that key. A module that brings any other file (one that
    would stay in the env's JIT workspace: another module's ``.so``, say) is dropped whole,
    and the probe generates it as it would without a plan."""
    kept: dict[str, dict[str, Any]] = {}
    for recipe, item in modules.items():
        key = str(item["key"])
        recorded: list[dict[str, str]] = []
        for variant in store.variants(key):
            with contextlib.suppress(EntryError, StoreError, OSError):
                recorded.append(store.load(key, variant).inputs)
        ninja = f"{item['dir']}/build.ninja"
        if not recorded or ninja not in item["files"]:
            continue
        try:
            every = all(
                rel == ninja
                or any(
                    inputs.get(rel)
                    == hashlib.sha256(localise_bytes(_decoded(record), prefix)).hexdigest()
                    for inputs in recorded
                )
                for rel, record in item["files"].items()
            )
        except EntryError:
            continue
        if every:
            kept[recipe] = item
    return kept


def _is_item(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    key, name, where, files = (item.get(k) for k in ("key", "name", "dir", "files"))
    if not (isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)):
        return False
    if not (isinstance(name, str) and isinstance(where, str) and _in_workspace(where)):
        return False
    if not isinstance(files, dict):
        return False
    return all(
        _in_workspace(p) and isinstance(f, dict) and isinstance(f.get("data"), str)
        and isinstance(f.get("sha256"), str)
        for p, f in files.items()
    )  # fmt: skip


def _in_workspace(path: object) -> bool:
    """A normalised path inside the env's JIT workspace: no ``..``, no empty component."""
    if not (isinstance(path, str) and path.startswith(WORKSPACE) and "\0" not in path):
        return False
    rest = path[len(WORKSPACE) :].split("/")
    return all(part not in ("", ".", "..") for part in rest)


def record_plan(store: Store, sig: str, modules: Mapping[str, dict[str, Any]]) -> None:
    """Add ``modules`` to the plan of ``sig`` (written whole and renamed into place); a plan
    that cannot be written costs the next build a probe, never this one."""
    if not modules:
        return
    with contextlib.suppress(OSError, StoreError):
        store.ready()
        where = store.root / "plans"
        with contextlib.suppress(FileExistsError):
            where.mkdir(mode=0o755)
        check_dir(where)
        doc = plan_doc(sig, {**read_plan(store, sig), **modules})
        data = json.dumps(doc, sort_keys=True).encode()
        if len(data) > 15 << 20:  # under the store's document bound, or it is never read
            return
        path = plan_path(store, sig)
        tmp = path.with_name(f".{path.name}.{tmp_tag()}.tmp")
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # whatever the umask: a plan others can write is never read
        os.replace(tmp, path)


def planned_module(
    prefix: str, ninja: str, build_dir: Path, key: str, name: str
) -> dict[str, Any] | None:
    """What to plan for the module FlashInfer just generated (and built or placed) in
    ``build_dir`` of the env at ``prefix``: its key, and every file of the build that lies in
    the env's JIT workspace and is not an output (build.ninja, generated sources and headers,
    embedded cubins), normalised. None when any is unreadable or too large."""
    roots = env_roots(prefix)
    try:
        edges = compdb(ninja, build_dir)
        outputs = {_absolute(e["output"], build_dir) for e in edges}
        wanted = {str(build_dir / "build.ninja")}
        wanted |= {_absolute(e["file"], build_dir) for e in edges if e.get("file")}
        with contextlib.suppress(OSError, ValueError):
            for _, deps in read_deps(build_dir / ".ninja_deps").values():
                wanted |= {_absolute(d, build_dir) for d in deps}
        for entry in os.scandir(build_dir):
            if entry.is_file(follow_symlinks=False) and not entry.name.startswith(".ninja_"):
                wanted.add(entry.path)
    except (OSError, ValueError, subprocess.SubprocessError):
        return None
    files: dict[str, dict[str, str]] = {}
    total = 0
    for path in sorted(wanted - outputs):
        rel = normalise(path, roots)
        if not _in_workspace(rel) or path.endswith(".lock"):
            continue  # a file some wheel installed: the new env has its own
        try:
            data = _bounded(Path(path), MAX_PLANNED_FILE + 1)
        except (OSError, EntryError):
            return None
        total += len(data)
        if len(data) > MAX_PLANNED_FILE or total > MAX_PLANNED_MODULE:
            return None
        body = normalise_bytes(data, roots)
        files[rel] = {
            "sha256": hashlib.sha256(body).hexdigest(),
            "data": base64.b64encode(body).decode(),
        }
    if f"{normalise(str(build_dir), roots)}/build.ninja" not in files:
        return None
    return {"key": key, "name": name, "dir": normalise(str(build_dir), roots), "files": files}


def _absolute(path: str, build_dir: Path) -> str:
    return os.path.normpath(path if os.path.isabs(path) else os.path.join(build_dir, path))


def normalise_bytes(data: bytes, roots: list[str]) -> bytes:
    for root in sorted({r.rstrip("/") for r in roots if r and r != "/"}, key=len, reverse=True):
        data = data.replace(root.encode(), ENV.encode())
    return data


def _safe_dir(prefix: Path, path: Path, made: list[Path]) -> None:
    """Make ``path`` (inside ``prefix``) and every directory down to it, following no link;
    each directory made is added to ``made``."""
    current = prefix
    for part in path.relative_to(prefix).parts:
        current = current / part
        with contextlib.suppress(FileExistsError):
            current.mkdir(mode=0o755)
            made.append(current)
        st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise EntryError(f"{current} is not a directory of the env (a link is not followed)")


def place_planned(
    store: Store,
    item: Mapping[str, Any],
    prefix: str,
    ninja: str,
    environ: Mapping[str, str],
    lock_wait: float,
    recorded: Recorded | None = None,
) -> tuple[str, str]:
    """Place one planned module into the env at ``prefix`` without FlashInfer: (outcome, what
    it rests on). Outcomes: ``placed`` (ninja -n finds nothing to do), ``present`` (the env
    has the module), ``absent`` (the store holds nothing under its key: a compile at first
    use, as without prefetch), ``unplanned`` (the plan does not hold here: the probe judges
    it; whatever was written is removed)."""
    root = Path(prefix)
    build_dir = Path(localise(str(item["dir"]), prefix))
    key = str(item["key"])
    if (build_dir / f"{item['name']}.so").exists():
        return "present", "the env has it"
    planned = f"{item['dir']}/build.ninja"
    try:
        text = _decoded(item["files"][planned]).decode()
        computed = key_of(
            material_of(store, localise(text, prefix), prefix, ninja, environ, recorded)
        )
    except (KeyError, EntryError, OSError, ValueError, subprocess.SubprocessError) as exc:
        return "unplanned", str(exc)
    if computed != key:
        # Another host compiler or NVCC_* variable than the plan's env had: the probe judges.
        return "unplanned", f"the key here is {computed[:16]}, planned {key[:16]}"
    if not store.variants(key):
        return "absent", f"no entry under {key[:16]}"
    made: list[Path] = []
    dirs: list[Path] = []
    try:
        for rel, record in sorted(item["files"].items()):
            data = localise_bytes(_decoded(record), prefix)
            path = Path(localise(rel, prefix))
            _safe_dir(root, path.parent, dirs)
            if os.path.lexists(path):
                if _bounded(path, len(data) + 1) != data:
                    raise EntryError(f"{path} differs from what was planned")
                continue
            tmp = path.with_name(f".{path.name[:200]}.{tmp_tag()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
            made.append(path)
        with store.locked(key, timeout=lock_wait):
            entry = place_ninja(store, key, build_dir, prefix, ninja)
        if entry is None:
            raise EntryError(f"no entry under {key[:16]} fits this env's inputs")
        said = no_work(ninja, build_dir)
        if said is not None:
            raise EntryError(f"ninja -n: {said}")
    except (EntryError, StoreError, OSError, ValueError, subprocess.SubprocessError) as exc:
        # What this placement wrote, and nothing else: the env is as it was.
        if build_dir in dirs:
            shutil.rmtree(build_dir, ignore_errors=True)
        for path in made:
            with contextlib.suppress(OSError):
                path.unlink()
        for path in reversed(dirs):
            with contextlib.suppress(OSError):
                path.rmdir()
        return "unplanned", str(exc)
    return "placed", f"entry {entry.path.name[:16]} under {key[:16]}; ninja -n: no work to do"


def _decoded(record: Mapping[str, str]) -> bytes:
    try:
        body = base64.b64decode(record["data"], validate=True)
    except ValueError as exc:
        raise EntryError(f"a planned file is not base64 ({exc})") from exc
    if hashlib.sha256(body).hexdigest() != record["sha256"]:
        raise EntryError("a planned file differs from its recorded sha256")
    return body


def localise_bytes(data: bytes, prefix: str) -> bytes:
    return data.replace(ENV.encode(), prefix.rstrip("/").encode())


def no_work(ninja: str, build_dir: Path) -> str | None:
    """None when ``ninja -n`` finds every output up to date, else what it would run."""
    done = subprocess.run(
        [ninja, "-C", str(build_dir), "-n"],
        capture_output=True,
        text=True,
        timeout=NINJA_TIMEOUT,
        check=False,
    )
    if done.returncode == 0 and "no work to do" in done.stdout:
        return None
    said = (done.stdout + done.stderr).strip().splitlines()
    return said[-1][-300:] if said else f"exit {done.returncode}"
