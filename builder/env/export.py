"""Lock -> what another tool or machine installs it from, every file checked against the lock.

- A wheelhouse: `cudaenv export SPEC --wheelhouse DIR` here, carry DIR over, then
  `cudaenv build SPEC --offline --wheelhouse DIR` there: uv installs from DIR alone
  (`--no-index --find-links DIR --offline`), still requiring every hash of the lock. Without
  `--wheelhouse`, an index-neutral lock's own wheelhouse (the directory its file paths name,
  beside it) is filled, so `uv pip install -r` / `pip install -r` of the lock itself work.
  pip downloads (uv has no download command), run by the spec's own Python so environment
  markers are evaluated for it; pip uses the machine's index configuration.
- A standard PEP 751 lock (`--pylock FILE`): the locked set with every file's URL on the index
  this machine's uv is configured with, for any PEP 751 reader (uv, pip >= 26).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from packaging.pylock import is_valid_pylock_path

from builder import store as jit_store
from builder.core import platforms, proc
from builder.core.errors import BuildError, SpecError, ToolMissing, UsageError
from builder.core.paths import jit_store_here
from builder.machine import interpreters
from builder.spec import project, resolve
from builder.spec.envspec import EnvSpec
from builder.spec.lock import Lock, LockedFile, LockedPackage
from builder.spec.lock import write as write_lock

MANIFEST = "cudaenv-export.json"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def lock_wheelhouse(spec: EnvSpec, lock: Lock, lock_file: Path) -> Path | None:
    """The wheelhouse an index-neutral lock's file paths name, as an absolute directory; None
    for a lock whose files carry URLs. What `cudaenv export SPEC` fills without --wheelhouse.

    The directory is the one the project configures (``[tool.cudaenv] wheelhouse``, relative
    to the lock's directory), never one a lock's path names: the export writes there, and an
    edited lock (``path = "../../../../elsewhere/x.whl"``, an absolute path) would have it
    write anywhere the user can. Every path must be ``<that wheelhouse>/<its file name>``, as
    resolve.pin_sources writes it; raises SpecError naming each one that is not."""
    wheelhouse = project.settings_for(spec.source).lock_wheelhouse
    problems = []
    named = False
    for pkg in lock.packages:
        for f in pkg.files:
            if f.path is None:
                continue
            named = True
            if wheelhouse is None or f.path != posixpath.join(wheelhouse, f.name):
                inside = (
                    f"the wheelhouse {wheelhouse}/ the project configures"
                    if wheelhouse is not None
                    else "any wheelhouse: the project's locks carry URLs"
                )
                problems.append(
                    f"{lock_file}: {pkg.name}=={pkg.version}: path: {f.path!r} is not in "
                    f"{inside}; refusing to write there (re-lock it with `cudaenv lock`)"
                )
    if problems:
        raise SpecError(problems, "lock")
    if not (named and wheelhouse):
        return None
    where = (lock_file.parent / wheelhouse).absolute()
    source = project.settings_for(spec.source).source
    root = source.parent if source is not None else lock_file.parent
    # A cloned project chooses this directory, and export writes into it: through `..` or a
    # link it must not reach outside the project (`../../../etc` as root writes into /etc).
    real, inside = os.path.realpath(where), os.path.realpath(root)
    if real != inside and not real.startswith(inside + os.sep):
        shown = f"{source}: tool.cudaenv.wheelhouse" if source is not None else "wheelhouse"
        raise SpecError(
            [
                f"{shown}: {wheelhouse!r} resolves to {real}, outside the project {inside}; "
                "export writes only inside it (or give --wheelhouse DIR)"
            ],
            "project settings",
        )
    return where


def check_wheelhouse(lock: Lock, wheelhouse: Path, platform: str | None = None) -> dict[str, str]:
    """name -> file for every package locked for ``platform`` (default: this machine's);
    raises naming what is missing or tampered."""
    by_hash: dict[str, Path] = {}
    for path in wheelhouse.iterdir():
        if path.is_file() and path.name.endswith((".whl", ".tar.gz", ".zip")):
            by_hash[sha256_of(path)] = path
    files: dict[str, str] = {}
    missing = []
    for pkg in lock.packages_on(platform or platforms.host_name()):
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


def pip_python(python: Path, scratch: Path) -> Path:
    """An interpreter of ``python``'s version that has pip: ``python`` itself, else a venv made
    from it in ``scratch`` with the pip its standard library bundles (``ensurepip``: no index
    needed). A venv made by uv (nox's, for one) has no pip of its own.

    The venv is made afresh for each export, never kept in cudaenv's cache: pip is a tree of
    code that no one hash could vouch for, and a kept copy another user could reach would run
    as whoever exports next (often root). Making it costs a few seconds of a download of
    gigabytes."""
    has = proc.run([python, "-m", "pip", "--version"], check=False, timeout=60)
    if has.returncode == 0:
        return python
    version = proc.run(
        [python, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"], timeout=60
    ).stdout.strip()
    venv = scratch / f"pip-python{version}"
    made = proc.run([python, "-m", "venv", "--clear", venv], check=False, timeout=300)
    if made.returncode != 0:
        raise ToolMissing(
            f"{python} has no pip and cannot make a venv with one ({made.stderr.strip()[-200:]}); "
            f"add pip with `{python} -m ensurepip` or install python{version[:4]}-venv",
            tool="pip",
        )
    return venv / "bin" / "python"


def _platform_args(platform: platforms.Platform, python: str) -> list[str]:
    """pip's options to pick another machine's wheels: its manylinux tags (2_34 and every
    older one a locked wheel may carry), CPython ``python``'s ABI, abi3 and pure wheels."""
    machine = platform.machine
    tags = [f"manylinux_2_{minor}_{machine}" for minor in range(34, 16, -1)]
    tags += [f"manylinux2014_{machine}", f"linux_{machine}"]
    nodot = python.replace(".", "")
    argv = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    argv += [f"--platform={t}" for t in tags]
    argv += [f"--abi=cp{nodot}", "--abi=abi3", "--abi=none"]
    return argv


def export(
    spec: EnvSpec,
    lock: Lock,
    wheelhouse: Path,
    progress: Callable[[str], None],
    platform: str | None = None,
) -> Path:
    """Download every file of the lock for ``platform`` (default: this machine's) into
    ``wheelhouse``, each hash-checked by pip. For another machine (an air-gapped aarch64
    cluster exported from x86_64) pip is told that machine's tags; a package whose lock has
    no wheel for it is fetched as its sdist."""
    found = interpreters.find(spec.python, allow_download=False)
    with tempfile.TemporaryDirectory(prefix="cudaenv-pip-") as scratch:
        pip = pip_python(found.path, Path(scratch))
        return _export(spec, lock, wheelhouse, progress, platform, pip)


def _export(
    spec: EnvSpec,
    lock: Lock,
    wheelhouse: Path,
    progress: Callable[[str], None],
    platform: str | None,
    pip: Path,
) -> Path:
    wheelhouse.mkdir(parents=True, exist_ok=True)
    host = platforms.host_name()
    target = platform or host
    if target not in lock.platforms:
        raise BuildError(
            f"the lock of {spec.name} is for {', '.join(lock.platforms)}, not {target}"
            + (" (this machine)" if platform is None else "")
        )
    packages = lock.packages_on(target)
    progress(
        f"downloading {len(packages)} locked files for {target} into {wheelhouse} with {pip} -m pip"
    )
    if target == host:
        # This machine's files: pip picks them for the interpreter that runs it.
        runs: list[tuple[list[str], str]] = [([], lock.requirements_txt(host))]
    else:
        binary = dataclasses.replace(lock, packages=tuple(p for p in packages if p.wheels))
        source = dataclasses.replace(lock, packages=tuple(p for p in packages if not p.wheels))
        runs = [
            (_platform_args(platforms.get(target), spec.python), binary.requirements_txt(target))
        ]
        if source.packages:
            runs.append((["--no-binary=:all:"], source.requirements_txt(target)))
    for extra, text in runs:
        _download(spec, pip, wheelhouse, extra, text)
    files = check_wheelhouse(lock, wheelhouse, target)
    doc = {"spec": spec.name, "lock_hash": lock.content_hash(), "platform": target, "files": files}
    return proc.atomic_write_text(
        wheelhouse / MANIFEST, json.dumps(doc, indent=2, sort_keys=True) + "\n"
    )


def _download(spec: EnvSpec, python: Path, wheelhouse: Path, extra: list[str], text: str) -> None:
    req = wheelhouse / f".requirements.{os.getpid()}.txt"
    req.write_text(text)
    try:
        proc.run(
            [python, "-m", "pip", "download", "--no-deps", "--require-hashes", *extra,
             "--disable-pip-version-check", "--progress-bar", "off", "-d", wheelhouse, "-r", req],
            stream=True,
            timeout=7200,
        )  # fmt: skip
    except proc.CommandFailed as exc:
        if "No module named pip" in exc.output:
            raise ToolMissing(
                f"{python} has no pip; add it with `{python} -m ensurepip`", tool="pip"
            ) from exc
        # pip's messages were streamed as it ran: not repeated here.
        raise BuildError(
            f"{spec.name}: downloading the lock failed (pip's messages above)"
        ) from exc
    finally:
        req.unlink(missing_ok=True)


# The store entries a wheelhouse carries (`export --with-jit`), in the store's own layout.
JIT_DIR = "jit-store"


def export_jit(env_dir: Path, wheelhouse: Path) -> int:
    """Copy the store entries the env at ``env_dir`` uses into ``wheelhouse/jit-store``, each
    file checked against its record, and write every carried file's sha256 into the
    wheelhouse's manifest; how many entries. Refuses an env that has none recorded (never
    verified, or the store off)."""
    store = jit_store_here()
    used = jit_store.used_entries(env_dir)
    if store is None or not used:
        raise BuildError(
            f"{env_dir} has no JIT results in the store to carry: verify it first "
            "(`cudaenv verify SPEC`) with the store on (CUDAENV_JIT_STORE is not `off`)"
        )
    carried: dict[str, str] = {}
    for rel in used:
        key, variant = jit_store.split_entry(rel) or ("", "")
        try:
            entry = store.load(key, store.entries(key) / variant)
            content, files = store.export_entry(entry)
        except (jit_store.EntryError, jit_store.StoreError, OSError) as exc:
            raise BuildError(
                f"the store's JIT result {rel}, which {env_dir} used, cannot be carried ({exc}): "
                "verify the env again, then export"
            ) from None
        carried.update(_write_entry(wheelhouse / JIT_DIR / rel, rel, content, files))
    manifest = wheelhouse / MANIFEST
    doc = json.loads(manifest.read_text()) if manifest.is_file() else {}
    doc["jit"] = dict(sorted(carried.items()))
    proc.atomic_write_text(manifest, json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return len(used)


def _write_entry(
    out: Path, rel: str, content: dict[str, object], files: dict[str, Path]
) -> dict[str, str]:
    """One entry laid out as the store lays it out; the sha256 of each file written."""
    if out.exists():
        shutil.rmtree(out)
    (out / "files").mkdir(parents=True)
    hashes = {}
    for name, src in files.items():
        shutil.copyfile(src, out / "files" / name)
        hashes[f"{rel}/files/{name}"] = sha256_of(out / "files" / name)
    (out / "entry.json").write_text(json.dumps(content, indent=1, sort_keys=True))
    hashes[f"{rel}/entry.json"] = sha256_of(out / "entry.json")
    return hashes


def import_jit(wheelhouse: Path) -> tuple[int, str | None]:
    """Add the JIT results a wheelhouse carries to this machine's store; how many were new,
    and why the store could not take them (then each is compiled where it is needed).
    Each file must have the sha256 the wheelhouse's manifest records (a file changed since
    the export is refused before anything is built); the store checks each again against the
    entry's own record, and once more whenever it places one."""
    store = jit_store_here()
    carried = wheelhouse / JIT_DIR
    if store is None or not carried.is_dir():
        return 0, None
    try:
        recorded = json.loads((wheelhouse / MANIFEST).read_text()).get("jit")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if not isinstance(recorded, dict):
        raise BuildError(
            f"{carried} holds JIT results but {wheelhouse / MANIFEST} records no sha256 for "
            "them: export the wheelhouse again with `cudaenv export SPEC --with-jit`"
        )
    found = sorted(
        str(p.parent.relative_to(carried))
        for p in carried.glob(f"{jit_store.VERSION}/*/*/*/entry.json")
    )
    added = 0
    for rel in found:
        split = jit_store.split_entry(rel)
        entry_dir = carried / rel
        names = sorted(p.name for p in (entry_dir / "files").iterdir()) if split else []
        paths = [f"{rel}/entry.json", *(f"{rel}/files/{n}" for n in names)]
        for path in paths:
            want = recorded.get(path)
            try:
                _, have = jit_store.sha256_file(carried / path, trusted=False)
            except jit_store.EntryError as exc:
                raise BuildError(f"{carried / path}: {exc}") from None
            if split is None or want is None or have != want:
                raise BuildError(
                    f"{carried / path}: not as exported ({MANIFEST} records "
                    f"{'another sha256' if want else 'no such file'}); the wheelhouse was changed "
                    "since `cudaenv export --with-jit`"
                )
        assert split is not None
        key, variant = split
        try:
            doc = jit_store.read_doc(entry_dir / "entry.json", trusted=False)
            existed = (store.entries(key) / variant).exists()
            store.import_entry(
                key,
                doc,
                {n: entry_dir / "files" / n for n in names},
                {"origin": f"wheelhouse {wheelhouse}"},
            )
        except jit_store.StoreError as exc:
            return added, f"the JIT results of {carried} were not added to the store: {exc}"
        except (jit_store.EntryError, OSError) as exc:
            raise BuildError(f"{entry_dir}: not a JIT result the store accepts ({exc})") from None
        added += not existed
    return added, None


def check_pylock_name(path: Path) -> None:
    """PEP 751 names: ``pylock.toml`` or ``pylock.NAME.toml`` with no dot in NAME; uv and pip
    refuse any other name."""
    if not is_valid_pylock_path(path):
        raise UsageError(
            f"--pylock {path}: not a PEP 751 file name; use pylock.toml or pylock.NAME.toml "
            "(NAME without dots)"
        )


def with_index_urls(
    spec: EnvSpec,
    lock: Lock,
    locate: Callable[[EnvSpec, list[LockedPackage]], tuple[LockedPackage, ...]],
) -> Lock:
    """``lock`` with every file's URL on the index this machine is configured with (asked of
    ``locate``: :func:`resolve.index_files`), hashes unchanged. A package the spec pins to an
    index keeps its own URL. Raises BuildError naming the package whose file the index does
    not serve, or serves with another hash."""
    served: dict[str, dict[str, LockedFile]] = {}
    for name in lock.platforms:
        # uv lists a platform's files only when asked for that platform.
        one = dataclasses.replace(spec, platforms=(name,))
        for p in locate(one, [p for p in lock.packages_on(name) if not p.index]):
            served.setdefault(p.name, {}).update({f.name: f for f in p.files})
    packages = []
    for pkg in lock.packages:
        if pkg.index:
            packages.append(pkg)
            continue
        found = served.get(pkg.name, {})
        packages.append(
            dataclasses.replace(
                pkg,
                wheels=tuple(_located(pkg, f, found) for f in pkg.wheels),
                sdist=_located(pkg, pkg.sdist, found) if pkg.sdist else None,
            )
        )
    return dataclasses.replace(lock, packages=tuple(packages))


def _located(pkg: LockedPackage, f: LockedFile, served: dict[str, LockedFile]) -> LockedFile:
    there = served.get(f.name)
    if there is None or not there.url:
        raise BuildError(
            f"{pkg.name}=={pkg.version}: the index this machine uses does not serve {f.name} "
            "(a file of the lock); export from a machine whose index has it"
        )
    if there.sha256 != f.sha256:
        raise BuildError(
            f"{pkg.name}=={pkg.version}: the index this machine uses serves {f.name} with sha256 "
            f"{there.sha256}, the lock has {f.sha256}; refusing to export another file than the "
            "locked one"
        )
    return dataclasses.replace(f, url=there.url, path=None)


def export_pylock(spec: EnvSpec, lock: Lock, out: Path, *, command: str) -> Path:
    """Write ``out``: the standard PEP 751 lock of ``lock`` with this machine's index URLs."""
    check_pylock_name(out)
    exported = with_index_urls(spec, lock, resolve.index_files)
    write_lock(dataclasses.replace(exported, command=command), out)
    return out
